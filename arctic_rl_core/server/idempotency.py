"""Request ids make retries of training calls safe: a replay returns the first outcome, never applies twice."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Awaitable, Callable

from arctic_rl_core.errors import InvalidRequest


class RequestIdConflict(InvalidRequest):
    """The request id was used before for a different request."""


MAX_KEY_CHARS = 128
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_KEY_CHARS or not set(request_id) <= _KEY_CHARS:
        raise InvalidRequest("X-Request-Id", f"must be at most {MAX_KEY_CHARS} characters of [A-Za-z0-9-_.:]")


class RequestLog:
    """The last `capacity` ordered requests by id; keys are bounded, so the log is too (about 1 MB)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[str, asyncio.Task]] = OrderedDict()

    async def once(self, request_id: str, fingerprint: str, run: Callable[[], Awaitable]):
        """Run `run()` the first time `request_id` is seen; replays await and return the same outcome.

        The work runs in its own task: a client that disconnects mid-call does not cancel it,
        and its retry gets the outcome of the one application.
        """
        check_request_id(request_id)
        entry = self._entries.get(request_id)
        if entry is None:
            task = asyncio.ensure_future(run())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # outcome is read by awaiters
            self._entries[request_id] = (fingerprint, task)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            seen, task = entry
            if seen != fingerprint:
                raise RequestIdConflict("X-Request-Id", f"{request_id!r} was already used for a different request")
        return await asyncio.shield(task)
