"""Runtime changes to other projects' code and state, as recorded patch objects.

Every attribute Arctic RL replaces in vLLM or verl modules and classes, every
entry it adds to their registries and every environment variable it sets for
them is a `Patch`: it records what it replaced and why, refuses to apply
twice, and can be reverted. A change to each of many objects of one model
instance (vLLM's linear layers, its parameters' storage) is an `InstancePatch`:
recorded on the instance, so it refuses to apply twice there, without keeping
the instance or its old tensors alive. `applied()` lists this process's
patches (`arctic-rl doctor --json`, the server's status route).
"""

from __future__ import annotations

import logging
import os
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

logger = logging.getLogger("arctic_rl.patches")

_MISSING = object()
_LOCK = threading.Lock()
_ACTIVE: dict[tuple[int, str, bool], "Patch"] = {}
_HISTORY: list["Patch"] = []
_INSTANCE_ROWS: dict[tuple[str, str, str], dict[str, Any]] = {}


class PatchConflict(RuntimeError):
    """A patch was applied twice to the same target."""


def _describe(target: Any) -> str:
    if target is os.environ:
        return "os.environ"
    if isinstance(target, types.ModuleType):
        return target.__name__
    if isinstance(target, type):
        return f"{target.__module__}.{target.__qualname__}"
    return f"{type(target).__module__}.{type(target).__qualname__} instance"


@dataclass(eq=False)
class Patch:
    target: Any
    """The module, class, object, dict or `os.environ` that is changed."""
    name: Any
    """The attribute (or, with `item`, the key) that is replaced or added."""
    make_replacement: Callable[[Any], Any]
    """Called with the original value (`None` where there was none); returns the new one."""
    reason: str
    item: bool = False
    """Change `target[name]` rather than `target.name`."""
    by: str = ""
    """The Arctic RL module that applies it."""
    where: str | None = None
    """How to name the target where its own name says little (a module's private dict)."""
    original: Any = field(default=_MISSING, init=False, repr=False)
    active: bool = field(default=False, init=False)

    @property
    def label(self) -> str:
        where = self.where or _describe(self.target)
        return f"{where}[{self.name!r}]" if self.item else f"{where}.{self.name}"

    def _key(self) -> tuple[int, str, bool]:
        return id(self.target), self.name, self.item

    def _get(self) -> Any:
        if self.item:
            return self.target[self.name] if self.name in self.target else _MISSING
        return getattr(self.target, self.name, _MISSING)

    def _set(self, value: Any) -> None:
        if value is _MISSING:
            if self.item:
                self.target.pop(self.name, None)
            else:
                delattr(self.target, self.name)
        elif self.item:
            self.target[self.name] = value
        else:
            setattr(self.target, self.name, value)

    def apply(self) -> "Patch":
        with _LOCK:
            if self._key() in _ACTIVE:
                raise PatchConflict(f"{self.label} is already patched by Arctic RL ({_ACTIVE[self._key()].reason})")
            self.original = self._get()
            self._set(self.make_replacement(None if self.original is _MISSING else self.original))
            self.active = True
            _ACTIVE[self._key()] = self
            _HISTORY.append(self)
        logger.info("arctic_rl patched %s: %s", self.label, self.reason)
        return self

    def revert(self) -> None:
        with _LOCK:
            if not self.active:
                return
            self._set(self.original)
            self.active = False
            del _ACTIVE[self._key()]

    @contextmanager
    def applied(self) -> Iterator["Patch"]:
        """Applied for the block only (an environment variable a library reads while it starts)."""
        self.apply()
        try:
            yield self
        finally:
            self.revert()


@dataclass(frozen=True)
class InstancePatch:
    name: str
    """What it changes, as listed: "linear layers multiply with F.linear on their kept weights"."""
    change: Callable[[Any], int]
    """Changes one instance; returns how many of its objects it changed."""
    reason: str
    by: str = ""

    def apply(self, instance: Any) -> int:
        marks = instance.__dict__.setdefault("_arctic_rl_patches", set())
        if self.name in marks:
            raise PatchConflict(f"{_describe(instance)}: {self.name!r} is already applied")
        changed = self.change(instance)
        marks.add(self.name)
        label = f"{_describe(instance)}: {self.name}"
        with _LOCK:
            row = _INSTANCE_ROWS.setdefault((label, self.reason, self.by),
                                            {"patch": label, "reason": self.reason, "by": self.by, "count": 0, "active": 0})
            row["count"] += 1
            row["active"] += 1
            row["objects"] = row.get("objects", 0) + changed
        logger.info("arctic_rl patched %s (%d objects): %s", label, changed, self.reason)
        return changed


def set_attribute(target: Any, name: str, value: Any, reason: str, by: str = "") -> Patch:
    """Apply a patch that sets `target.name` to `value`."""
    return Patch(target, name, lambda _: value, reason, by=by).apply()


def set_item(target: Any, name: Any, value: Any, reason: str, by: str = "", where: str | None = None) -> Patch:
    """Apply a patch that sets `target[name]` to `value` (a registry entry)."""
    return Patch(target, name, lambda _: value, reason, item=True, by=by, where=where).apply()


def environment(name: str, value: str, reason: str, by: str = "") -> Patch:
    """A patch of `os.environ[name]`; use `.applied()` to scope it or `.apply()` to keep it."""
    return Patch(os.environ, name, lambda _: value, reason, item=True, by=by)


def environment_default(name: str, value: str, reason: str, by: str = "") -> Patch | None:
    """Set an environment variable another library reads, unless the user (or an earlier call) set it."""
    with _LOCK:
        if name in os.environ:
            return None
    return environment(name, value, reason, by).apply()


def applied() -> list[dict[str, Any]]:
    """This process's patches, grouped by what they change: label, reason, by, how many, how many still active."""
    with _LOCK:
        history = list(_HISTORY)
        instance_rows = [dict(row) for row in _INSTANCE_ROWS.values()]
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for patch in history:
        label = patch.label
        row = rows.setdefault((label, patch.reason, patch.by),
                              {"patch": label, "reason": patch.reason, "by": patch.by, "count": 0, "active": 0})
        row["count"] += 1
        row["active"] += int(patch.active)
    return list(rows.values()) + instance_rows
