"""Tinker's futures: every call answers with a request id at once; `retrieve_future` long-polls for the result.

The SDK re-polls the moment it hears "try again", so a poll is held until the result is ready or `poll_s` has
passed (under the SDK's 45 s timeout). Training calls run in the order of their `seq_id` (the SDK sends a
forward_backward's chunks at once and the first one last), whatever order their requests arrive in.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from typing import Any, Callable

from arctic_rl_core.errors import InvalidRequest, NotFound
from arctic_rl_core.server.limits import OverLimit


class FutureTable:
    """Request ids and their futures, each a tenant's. A tenant's pending requests and kept results have caps of
    their own, so one tenant's flood neither crowds out nor forgets another's; the server-wide caps bound the rest."""

    def __init__(self, poll_s: float = 25.0, max_pending: int = 1024, max_done: int = 8192,
                 per_tenant_pending: int = 256, per_tenant_done: int = 1024):
        self.poll_s, self.max_pending, self.max_done = poll_s, max_pending, max_done
        self.per_tenant_pending, self.per_tenant_done = per_tenant_pending, per_tenant_done
        self._futures: OrderedDict[str, tuple[asyncio.Future, Callable[[Any], Any], str]] = OrderedDict()

    def add(self, encode: Callable[[Any], Any], tenant: str) -> tuple[str, asyncio.Future]:
        """A new request id and the future its work resolves; `encode` makes the result a response, for `tenant`
        alone."""
        pending = [t for f, _, t in self._futures.values() if not f.done()]
        own = pending.count(tenant)
        if own >= self.per_tenant_pending:
            raise OverLimit("request", f"{own} of this tenant's Tinker requests are already waiting (its cap)")
        if len(pending) >= self.max_pending:
            raise OverLimit("request", f"{len(pending)} Tinker requests are already waiting (the server's cap)")
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = (future, encode, tenant)
        self._forget_oldest_done(tenant)
        return request_id, future

    def _forget_oldest_done(self, tenant: str) -> None:
        done = [(key, t) for key, (f, _, t) in self._futures.items() if f.done()]
        own = [key for key, t in done if t == tenant]
        for key in own[: max(0, len(own) - self.per_tenant_done)]:
            del self._futures[key]
        done = [key for key, _ in done if key in self._futures]
        for key in done[: max(0, len(done) - self.max_done)]:
            del self._futures[key]

    async def retrieve(self, request_id: str, tenant: str) -> tuple[str, Any]:
        """("pending", None), ("done", response) or ("failed", the exception). A result stays retrievable (a poll
        whose answer was lost is answered again) until `max_done` later results push it out."""
        entry = self._futures.get(request_id)
        if entry is None or entry[2] != tenant:
            raise NotFound("request_id", f"no Tinker request has the id {request_id!r} (or it was long retrieved)")
        future, encode, _ = entry
        try:
            result = await asyncio.wait_for(asyncio.shield(future), self.poll_s)
        except asyncio.TimeoutError:
            return "pending", None
        except Exception as err:  # the call's own failure is its answer
            return "failed", err
        return "done", encode(result)


class SeqOrder:
    """Starts a model's calls in `seq_id` order: a call waits for the ones numbered before it to start."""

    def __init__(self, first: int = 1, max_waiting: int = 256, max_remembered: int = 1024):
        self.next, self.max_waiting, self.max_remembered = first, max_waiting, max_remembered
        self._waiting: dict[int, Callable[[], None]] = {}
        self.issued: dict[int, str] = {}
        """seq_id -> request id of the last `max_remembered` calls: a call sent twice (the SDK's retries) is one."""

    def admit(self, seq_id: int, start: Callable[[], None]) -> None:
        if seq_id < self.next:
            raise InvalidRequest("seq_id", f"{seq_id} has already run on this model (next is {self.next})")
        if len(self._waiting) >= self.max_waiting:
            raise OverLimit("seq_id", f"{len(self._waiting)} calls already wait for seq_id {self.next}")
        self._waiting[seq_id] = start
        while self.next in self._waiting:
            self._waiting.pop(self.next)()
            self.issued.pop(self.next - self.max_remembered, None)
            self.next += 1

    def skip(self, seq_id: object) -> None:
        """A call refused before it ran still takes its turn: the calls numbered after it do not wait for it."""
        if isinstance(seq_id, int) and seq_id >= self.next and seq_id not in self._waiting and seq_id not in self.issued:
            self.admit(seq_id, lambda: None)
