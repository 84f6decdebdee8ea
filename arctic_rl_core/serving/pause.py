"""Pausing generation for a weight update, as vLLM's `/pause` and `/resume` do.

`pause(mode)`: new requests wait until `resume`; requests in flight are
- `abort`: answered at once with finish reason "abort": on a continuously batched
  sampler (vLLM's engine) with the tokens and log-probs sampled so far, elsewhere
  with none (the call runs on, and its answer is dropped);
- `wait`: left to finish; `pause` returns once none is in flight;
- `keep`: frozen where they are, as vLLM's `keep` does, on a sampler that can
  (`Sampler.pause_generation`: vLLM's engine); a weight sync before `resume`
  applies to the rest of each request, whose tokens then carry two versions
  (`Completion.token_versions`). Another sampler runs them to their end under
  the weights they started with.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Literal

PauseMode = Literal["abort", "wait", "keep"]


class Aborted(Exception):
    """The request was in flight when a `pause(mode="abort")` came."""


class ClientGone(Exception):
    """The request's client disconnected before its answer."""


class PauseGate:
    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight: set[asyncio.Future] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.aborted = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @asynccontextmanager
    async def admitted(self):
        """Hold a request while paused; inside, `await gate.run(awaitable)` is cut short by an abort."""
        await self._open.wait()
        abort = asyncio.get_running_loop().create_future()
        self._in_flight.add(abort)
        self._drained.clear()
        try:
            yield abort
        finally:
            self._in_flight.discard(abort)
            if not self._in_flight:
                self._drained.set()

    @staticmethod
    async def run(abort: asyncio.Future, work: asyncio.Future, gone: asyncio.Future | None = None):
        """The result of `work`, or `Aborted` if the request is aborted first, or `ClientGone` if `gone` (its
        client's disconnect) ends first."""
        done, _ = await asyncio.wait({abort, work} | ({gone} if gone is not None else set()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        if abort in done:
            raise Aborted()
        raise ClientGone()

    async def pause(self, mode: PauseMode) -> None:
        self._open.clear()
        if mode == "abort":
            for abort in list(self._in_flight):
                if not abort.done():
                    abort.set_result(None)
                    self.aborted += 1
        elif mode == "wait":
            await self._drained.wait()

    def resume(self) -> None:
        self._open.set()

    def describe(self) -> dict:
        return {"paused": self.paused, "in_flight": len(self._in_flight), "aborted": self.aborted}
