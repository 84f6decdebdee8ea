"""Concurrent requests become one `generate` call: the sampler batches what harnesses send one at a time.

Agent harnesses send one request per conversation turn, many at once. Sent one by one, each is its own
engine call and a single sampler runs them one after another. Here requests with the same sampling
parameters join a batch; the batch closes once no request joined it for `idle_s`, or it waited
`max_wait_s`, and goes to the sampler when fewer than `max_in_flight` calls are running. While the sampler
is busy, batches of the same parameters wait and go as one call when it frees (up to `max_prompts`):
requests that trickle in during a long call are one call after it, not one call each. If a batched call is refused,
each of its requests is retried on its own, so a bad request gets its own error and the others their
completions.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Completion, SamplingParams


@dataclass(eq=False)  # a batch is itself: found by identity in the queues
class _Batch:
    key: str
    sampling: SamplingParams
    started: float
    requests: list[tuple[list[list[int]], asyncio.Future]] = field(default_factory=list)
    prompts: int = 0
    timer: asyncio.TimerHandle | None = None


class Coalescer:
    def __init__(self, generate: Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]],
                 max_in_flight: int = 1, max_prompts: int = 256, idle_s: float = 0.005, max_wait_s: float = 0.05):
        self._generate = generate
        self.max_in_flight, self.max_prompts, self.idle_s, self.max_wait_s = max_in_flight, max_prompts, idle_s, max_wait_s
        self._open: dict[str, _Batch] = {}
        self._ready: list[_Batch] = []
        self._in_flight = 0
        self.calls = 0
        self.requests = 0

    async def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        loop = asyncio.get_running_loop()
        key = sampling.model_dump_json()
        batch = self._open.get(key)
        if batch is None or batch.prompts + len(prompts) > self.max_prompts:
            if batch is not None:
                self._close(batch)
            batch = self._open[key] = _Batch(key, sampling, time.monotonic())
        done = loop.create_future()
        batch.requests.append((prompts, done))
        batch.prompts += len(prompts)
        self.requests += 1
        if batch.timer is not None:
            batch.timer.cancel()
        waited = time.monotonic() - batch.started
        batch.timer = loop.call_later(max(0.0, min(self.idle_s, self.max_wait_s - waited)), self._close, batch)
        return await done

    def _close(self, batch: _Batch) -> None:
        """No more requests join `batch`; it goes to the sampler when a call is free."""
        if batch.timer is not None:
            batch.timer.cancel()
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]
        self._ready.append(batch)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._ready and self._in_flight < self.max_in_flight:
            batch = self._ready.pop(0)
            waiting = [b for b in self._ready if b.key == batch.key]
            if batch.key in self._open:  # the sampler is free now: no reason to wait out its timer
                waiting.append(self._open[batch.key])
            for other in waiting:
                if batch.prompts + other.prompts > self.max_prompts:
                    break
                if other in self._ready:
                    self._ready.remove(other)
                else:
                    other.timer.cancel()
                    del self._open[batch.key]
                batch.requests += other.requests
                batch.prompts += other.prompts
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: _Batch) -> None:
        try:
            self.calls += 1
            prompts = [p for request, _ in batch.requests for p in request]
            try:
                completions = await self._generate(prompts, batch.sampling)
            except InvalidRequest:
                if len(batch.requests) == 1:
                    raise
                for request, done in batch.requests:  # each on its own: the bad one gets its own error
                    await self._one(request, batch.sampling, done)
                return
            start = 0
            for request, done in batch.requests:
                end = start + len(request)
                if not done.done():
                    done.set_result([c.model_copy(update={"prompt_index": c.prompt_index - start})
                                     for c in completions if start <= c.prompt_index < end])
                start = end
        except BaseException as err:
            for _, done in batch.requests:
                if not done.done():
                    done.set_exception(err)
        finally:
            self._in_flight -= 1
            self._dispatch()

    async def _one(self, prompts, sampling, done: asyncio.Future) -> None:
        try:
            result = await self._generate(prompts, sampling)
        except BaseException as err:
            if not done.done():
                done.set_exception(err)
            return
        if not done.done():
            done.set_result(result)

    def describe(self) -> dict:
        return {"requests": self.requests, "generate_calls": self.calls}
