"""Discovers plugins from the `arctic_rl` entry-point group and builds the registries they fill.

`load_plugins()` returns a new `PluginManager` holding this process's losses,
post-processors, engines, samplers and commands; the backend keeps the one it
was built with. Nothing is registered by importing a module. A plugin that
fails to import, register or answer a hook is recorded with its error and
distribution; the others still load. Nothing is skipped silently:
`arctic-rl plugins` prints the failures.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from arctic_rl_core.errors import UnknownName
from arctic_rl_core.losses.registry import Registered, Registry
from arctic_rl_core.plugins import hookspecs

GROUP = "arctic_rl"


@dataclass
class Provided:
    kind: str
    name: str
    plugin: str
    distribution: str
    version: str


@dataclass
class Failure:
    plugin: str
    distribution: str
    stage: str
    error: str
    traceback: str


@dataclass
class PluginManager:
    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager(hookspecs.PROJECT))
    losses: Registry = field(default_factory=lambda: Registry("loss"))
    post_processors: Registry = field(default_factory=lambda: Registry("post-processor"))
    provided: list[Provided] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    engines: dict[str, Callable[..., Any]] = field(default_factory=dict)
    samplers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    commands: dict[tuple[str, ...], Any] = field(default_factory=dict)
    """Command path (say ("bench", "zorro")) -> `Command` for the `arctic-rl` command line."""
    _origin: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def __post_init__(self):
        self.pm.add_hookspecs(hookspecs)

    def load_entry_points(self, group: str = GROUP) -> None:
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                module = ep.load()
                self.pm.register(module, name=ep.name)
            except Exception as exc:  # a broken plugin must not stop the others
                self._fail(ep.name, dist, "load", exc)
                continue
            self._origin[ep.name] = (ep.name, dist, version)
        self._collect()

    def _fail(self, plugin: str, dist: str, stage: str, exc: BaseException) -> None:
        self.failures.append(
            Failure(plugin, dist, stage, f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))
        )

    def add(self, module: Any, name: str, distribution: str = "?", version: str = "?") -> None:
        """Register one plugin module by hand (tests, embedding applications) and collect what it provides."""
        self.pm.register(module, name=name)
        self._origin[name] = (name, distribution, version)
        self._collect(only=name)

    def _collect(self, only: str | None = None) -> None:
        for hook_name, kind in (
            ("arctic_rl_loss_fns", "loss"),
            ("arctic_rl_post_processors", "post_processor"),
            ("arctic_rl_training_engines", "engine"),
            ("arctic_rl_samplers", "sampler"),
            ("arctic_rl_framework_adapters", "adapter"),
            ("arctic_rl_commands", "command"),
        ):
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if only is not None and impl.plugin_name != only:
                    continue
                plugin, dist, version = self._origin.get(impl.plugin_name, (impl.plugin_name, "?", "?"))
                try:
                    result = impl.function()
                    for name in self._accept(kind, result):
                        self.provided.append(Provided(kind, name, plugin, dist, version))
                except Exception as exc:
                    self._fail(plugin, dist, hook_name, exc)

    def _accept(self, kind: str, result: Any) -> list[str]:
        if kind in ("loss", "post_processor"):
            registry = self.losses if kind == "loss" else self.post_processors
            names = []
            for fn in result:
                entry: Registered | None = getattr(fn, "arctic_rl_registered", None)
                if entry is None:
                    raise TypeError(f"{fn!r} was not decorated with @register_{'loss_fn' if kind == 'loss' else kind}")
                registry.add(entry)
                names.append(entry.name)
            return names
        if kind == "command":
            names = []
            for command in result:
                if command.path in self.commands:
                    raise ValueError(f"command {' '.join(command.path)!r} is already provided by another plugin")
                self.commands[command.path] = command
                names.append(" ".join(command.path))
            return names
        target = {"engine": self.engines, "sampler": self.samplers, "adapter": self.adapters}[kind]
        for name, value in dict(result).items():
            if name in target and target[name] is not value:
                raise ValueError(f"{kind} {name!r} is already provided by another plugin")
            target[name] = value
        return list(dict(result))

    def engine_factory(self, name: str, field: str = "engine.name") -> Callable[..., Any]:
        if name not in self.engines:
            raise UnknownName.of(field, "training engine", name, list(self.engines))
        return self.engines[name]

    def sampler_factory(self, name: str, field: str = "sampler.name") -> Callable[..., Any]:
        if name not in self.samplers:
            raise UnknownName.of(field, "sampler", name, list(self.samplers))
        return self.samplers[name]

    def report(self) -> dict[str, Any]:
        return {
            "plugins": [vars(p) for p in self.provided],
            "failures": [{k: v for k, v in vars(f).items() if k != "traceback"} for f in self.failures],
        }


def load_plugins(group: str = GROUP) -> PluginManager:
    """A manager with every installed plugin of `group` loaded and its registries filled."""
    manager = PluginManager()
    manager.load_entry_points(group)
    return manager
