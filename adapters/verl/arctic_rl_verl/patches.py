"""Runtime changes to verl's own code, as recorded patch objects (never silent monkeypatching).

Each patch records what it replaced and refuses to apply twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)
APPLIED: dict[str, "Patch"] = {}


@dataclass
class Patch:
    target: Any
    """The module or class whose attribute is replaced."""
    attribute: str
    make_replacement: Callable[[Any], Any]
    """Called with the original attribute; returns the replacement."""
    reason: str
    original: Any = field(default=None, init=False)

    @property
    def key(self) -> str:
        return f"{getattr(self.target, '__name__', self.target)}.{self.attribute}"

    def apply(self) -> None:
        if self.key in APPLIED:
            raise RuntimeError(f"{self.key} is already patched by arctic_rl_verl ({APPLIED[self.key].reason})")
        self.original = getattr(self.target, self.attribute)
        setattr(self.target, self.attribute, self.make_replacement(self.original))
        APPLIED[self.key] = self
        logger.info("arctic_rl patched %s: %s", self.key, self.reason)
