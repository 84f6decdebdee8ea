"""A caller's way to end its own `generate` call early: a client that disconnected or gave up on its turn.

The serving routes hand one to `generate` and cancel it when the client goes; the sampler hears of it through
`on_cancel` and ends that call's requests in its engine at the next step, so the call returns what it sampled so
far (finish reason `abort`) and other calls go on. A sampler that cannot end one call early runs it to its end.
"""

from __future__ import annotations

import threading
from typing import Callable


class Cancellation:
    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        """From any thread; the callbacks run on this one, once."""
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """`callback()` when cancelled: now, if it already was. It must return at once."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return
        callback()
