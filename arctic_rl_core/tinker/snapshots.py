"""Which saved weights the sampler holds, where it serves no adapters: Tinker's sampler snapshots.

A LoRA job whose sampler serves adapters samples every saved model as an adapter on the base weights, which the
sampler never leaves. Any other job (all parameters, or a sampler without adapters) has one set of weights in its
sampler. There a save for the sampler writes the model's full weights to disk (a snapshot), and a sample of a
snapshot the sampler does not hold waits until the samples in flight on the one it holds end, then loads it. So the
base model and every kept snapshot sample their own weights, whatever was saved since: the behaviour of Tinker, whose
sampling clients keep working after newer saves.
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from typing import AsyncIterator

from arctic_rl_core.errors import InvalidRequest

BASE = "base"
"""The snapshot of the base model: the weights the sampler started with (weight version 0)."""


class SamplerHold:
    """On the event loop: the snapshot the sampler holds, under which weight version, and the samples on it."""

    def __init__(self):
        self.key: str | None = BASE
        self.version = 0
        self.in_flight = 0
        self.waiting: dict[int, str] = {}
        """Samples waiting for the sampler: arrival ticket -> the snapshot each wants."""
        self._tickets = itertools.count()
        self.loading = False
        self._changed: asyncio.Condition | None = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # made on the event loop that uses it
            self._changed = asyncio.Condition()
        return self._changed

    def holds(self, api, key: str) -> bool:
        # The training API's own sync replaces the sampler's weights too: then it holds no snapshot.
        return self.key == key and api.weight_version == self.version

    @asynccontextmanager
    async def holding(self, api, key: str, folder: str | None) -> AsyncIterator[int]:
        """The sampler holds snapshot `key` (saved in `folder`) while the block runs: the weight version its samples
        must carry. Samples wait in order of arrival across snapshots: one of the held snapshot starts unless a
        sample of another arrived before it; that one loads its snapshot once the samples in flight end."""
        loop = asyncio.get_running_loop()
        ticket = next(self._tickets)
        async with self.changed:
            self.waiting[ticket] = key
        try:
            while True:
                async with self.changed:
                    first_other = min((t for t, k in self.waiting.items() if k != key), default=None)
                    if self.holds(api, key) and not self.loading and (first_other is None or ticket < first_other):
                        self.in_flight += 1
                        version = self.version
                        break
                    if self.holds(api, key) or self.loading or self.in_flight:
                        await self.changed.wait()
                        continue
                    if folder is None:
                        raise InvalidRequest("sampling_session_id", "its weights are no longer kept on this server")
                    self.loading = True
                try:
                    version = await loop.run_in_executor(None, api.load_sampler_weights, folder)
                    self.key, self.version = key, version
                finally:
                    async with self.changed:
                        self.loading = False
                        self.changed.notify_all()
        finally:
            async with self.changed:
                del self.waiting[ticket]
                self.changed.notify_all()
        try:
            yield version
        finally:
            async with self.changed:
                self.in_flight -= 1
                self.changed.notify_all()
