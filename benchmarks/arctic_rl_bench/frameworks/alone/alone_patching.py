"""What every framework's alone patches share: the patch object, its once-per-process record, and import hooks that
patch a module as it is first imported, in whichever process imports it.

Self-contained on purpose, like the patch modules that import it: the alone columns import nothing of Arctic RL.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AlonePatch:
    name: str
    why: str
    timing: str
    """Why the phases the bench times are not changed by it."""
    needed: Callable[[], bool]
    """Whether this process needs it (no GPU; the module it patches is in use here)."""
    apply: Callable[[], None]


class AppliedTwice(RuntimeError):
    pass


APPLIED: list[str] = []


def apply(patch: AlonePatch) -> bool:
    """Apply `patch` where this process needs it; False where it does not. A second application raises."""
    if patch.name in APPLIED:
        raise AppliedTwice(f"the alone patch {patch.name!r} is already applied in this process")
    if not patch.needed():
        return False
    patch.apply()
    APPLIED.append(patch.name)
    return True


def listing(patches) -> list[dict[str, str]]:
    return [{"name": p.name, "why": p.why, "timing": p.timing} for p in patches]


def no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once the module `name` is first imported in this process, by whoever imports it: a
    patch of a module that only some processes use must not import it into the others."""

    def __init__(self, name: str, then: Callable):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def when_imported(name: str, then: Callable) -> None:
    """`then(module)` on the module `name`: now if this process has imported it, else once it first does."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, AfterImport(name, then))


class BeforeImport(importlib.abc.MetaPathFinder):
    """Calls `then()` once, just before the module `name` is first imported in this process: for a patch that must
    be in place before that module's own imports bind names from the module it patches."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then, self.done = name, then, False

    def find_spec(self, fullname, path, target=None):
        # It stays in sys.meta_path, spent: removing itself while the import system walks the list would make that
        # walk skip the next finder (another patch's hook for the same module).
        if fullname == self.name and not self.done:
            self.done = True
            self.then()
        return None
