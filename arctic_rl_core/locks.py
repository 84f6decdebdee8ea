"""A readers-writer lock: many sharers, or one exclusive holder that goes before new sharers."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class SharedLock:
    """Exclusive when entered (`with lock:`), or shared among holders of `lock.shared()`. A waiting exclusive
    holder goes before new sharers, so a stream of generate calls cannot starve sync_weights."""

    def __init__(self):
        self._state = threading.Condition()
        self._sharers = 0
        self._exclusive = False
        self._waiting = 0

    def __enter__(self):
        with self._state:
            self._waiting += 1
            self._state.wait_for(lambda: not self._exclusive and not self._sharers)
            self._waiting -= 1
            self._exclusive = True

    def __exit__(self, *exc):
        with self._state:
            self._exclusive = False
            self._state.notify_all()

    @contextmanager
    def shared(self):
        with self._state:
            self._state.wait_for(lambda: not self._exclusive and not self._waiting)
            self._sharers += 1
        try:
            yield
        finally:
            with self._state:
                self._sharers -= 1
                self._state.notify_all()
