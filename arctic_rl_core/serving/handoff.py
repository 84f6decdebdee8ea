"""Tokens from the engine's thread to the event loop's streams: one wake-up of the loop for all that came at once.

The engine's thread tells each streamed request of its tokens after every engine step. Handed over one by one
(`call_soon_threadsafe` each), 32 streams wake the event loop 32 times a step, each a write to its self-pipe and a
contest for the interpreter lock with the thread that must get on to the next step. Here an item waits in a
queue of the loop's own, and only the first since the loop last emptied it wakes the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any


class Handoff:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._woken = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: `queue.put_nowait(item)` on the loop, after every item put before it."""
        with self._lock:
            self._items.append((queue, item))
            if self._woken:
                return
            self._woken = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._woken = False
        for queue, item in items:
            queue.put_nowait(item)
