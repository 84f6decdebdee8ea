"""Hook specifications: what a plugin can provide.

Each hook returns what one plugin contributes; the manager calls every
implementation separately so it can say which distribution provided what,
and so one broken plugin cannot hide the others.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

PROJECT = "arctic_rl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def arctic_rl_loss_fns() -> list[Callable[..., Any]]:
    """Loss functions decorated with `@register_loss_fn`."""


@hookspec
def arctic_rl_post_processors() -> list[Callable[..., Any]]:
    """Post-processors decorated with `@register_post_processor`."""


@hookspec
def arctic_rl_training_engines() -> dict[str, Callable[..., Any]]:
    """Engine name -> factory `f(config: BackendConfig) -> TrainingEngine`."""


@hookspec
def arctic_rl_samplers() -> dict[str, Callable[..., Any]]:
    """Sampler name -> factory `f(config: BackendConfig) -> Sampler`."""


@hookspec
def arctic_rl_framework_adapters() -> dict[str, str]:
    """Framework name -> one-line description of how the adapter is selected."""


@dataclass(frozen=True)
class Command:
    """An `arctic-rl` subcommand a plugin adds (the recipes add `train` and `demo`, the benchmarks `bench …`)."""

    path: tuple[str, ...]
    """("train",) or ("bench", "zorro"): a parent that no command provides is a plain group."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    needs_accelerator: bool = True
    """Select the torch accelerator before running (false keeps a command from importing torch)."""


@hookspec
def arctic_rl_commands() -> list[Command]:
    """Subcommands of the `arctic-rl` command line."""
