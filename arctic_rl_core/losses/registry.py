"""Registries of loss functions and post-processors.

`@register_loss_fn("name")` and `@register_post_processor("name")` declare a
function under a public name; a plugin's hook returns it and the plugin
manager adds it to the registries it builds (importing a module registers
nothing). Registering a name twice with different functions is an error, so
two plugins cannot silently shadow each other.
Each entry may carry a pydantic config model: unknown config keys are then
rejected with the key's name before any model work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pydantic

from arctic_rl_core.errors import InvalidRequest, UnknownName
from arctic_rl_core.validation import parse


@dataclass(frozen=True)
class Registered:
    """A registered loss or post-processor."""

    name: str
    fn: Callable[..., Any]
    config_model: type[pydantic.BaseModel] | None = None
    requires: tuple[str, ...] = ()
    """Per-token `Sequence` fields the function needs (e.g. "advantages")."""
    reads: tuple[str, ...] = ()
    """Optional per-token fields that change the loss when present ("is_weights"); others are refused."""
    source: str = ""
    """Where it came from: the defining module (the plugin manager adds the distribution)."""
    model: str = "policy"
    """The model a loss trains: "policy" (its outputs are log-probs) or "critic" (values)."""

    def parse_config(self, config: dict[str, Any], where: str) -> Any:
        if self.config_model is None:
            if config:
                raise InvalidRequest(f"{where}.{next(iter(config))}", f"{self.name!r} takes no config")
            return None
        return parse(self.config_model, config, where)

    def required_fields(self, config: Any) -> tuple[str, ...]:
        """Fields needed under this config; a config may add to them (e.g. a KL term needs ref_logprobs)."""
        extra = config.required_fields() if hasattr(config, "required_fields") else ()
        return tuple(dict.fromkeys(self.requires + tuple(extra)))


@dataclass
class Registry:
    kind: str
    entries: dict[str, Registered] = field(default_factory=dict)

    def add(self, entry: Registered) -> Registered:
        existing = self.entries.get(entry.name)
        if existing is not None and existing.fn is not entry.fn:
            raise ValueError(
                f"{self.kind} {entry.name!r} is already registered by {existing.source}; "
                f"{entry.source} tried to register a different function under the same name"
            )
        self.entries[entry.name] = entry
        return entry

    def get(self, name: str, where: str) -> Registered:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownName.of(where, self.kind, name, list(self.entries)) from None

    def names(self) -> list[str]:
        return sorted(self.entries)


def _decorator(name: str, config: type[pydantic.BaseModel] | None, requires: tuple[str, ...], model: str,
               reads: tuple[str, ...] = ()):
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.arctic_rl_registered = Registered(name, fn, config, tuple(requires), tuple(reads),
                                             f"{fn.__module__}.{fn.__qualname__}", model)
        return fn

    return wrap


def register_loss_fn(name: str, *, config: type[pydantic.BaseModel] | None = None, requires: tuple[str, ...] = (),
                     model: str = "policy", reads: tuple[str, ...] = ()):
    """Declare `fn(outputs, inputs, config) -> (loss, metrics)` as loss `name`.

    `outputs` maps "logprobs" (and "entropy" when the config asks for it) to
    per-response-token tensors, or, for a critic's loss (`model="critic"`), "values";
    `inputs` is a `LossInputs`; the loss must be a scalar normalised with the *global*
    denominators in `inputs` so that micro-batch losses add up to the batch loss.
    """
    return _decorator(name, config, requires, model, reads)


def register_post_processor(name: str, *, config: type[pydantic.BaseModel] | None = None):
    """Declare `fn(outputs, inputs, config) -> dict` as post-processor `name`.

    Post-processors run in order on the response-position logits before the
    loss; each returns the entries it adds to or replaces in `outputs`.
    """
    return _decorator(name, config, (), "policy")
