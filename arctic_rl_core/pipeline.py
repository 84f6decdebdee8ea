"""Async rollout pipelining: generation for the next steps overlaps training of this one.

`max_staleness` k bounds how far generation runs ahead. k = 0 is synchronous:
step t+1 is generated only after step t's weights are synced. With k >= 1,
generation for steps t+1 ... t+k is already under way while step t trains, on
weights up to k versions old. A completion whose weights are more than k
versions behind when its batch is taken is dropped and counted. Each kept
completion carries its `weight_version` (the oldest version among its tokens; `token_versions` where a sync
crossed it), which are the `behaviour_version(s)` the
decoupled (off-policy) loss terms need.

It lives in the core, not in a recipe, so framework adapters can use it too.
It uses only the training API (`api.futures`), in process or over HTTP.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Completion, SamplingParams


@dataclass
class RolloutBatch:
    step: int
    prompts: list[list[int]]
    completions: list[Completion]
    """Kept completions, in prompt order; `prompt_index` points into `prompts`."""
    staleness: int
    """Weight versions between the oldest kept completion and the trainer when the batch was taken."""
    dropped: int
    """Completions of this batch dropped for being too stale."""


class RolloutPipeline:
    def __init__(self, api: TrainingAPI, prompts_for_step: Callable[[int], list[list[int]]],
                 sampling: SamplingParams, max_staleness: int = 0):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise InvalidRequest("pipeline.max_staleness", f"must be an integer >= 0, got {max_staleness!r}")
        self.api = api
        self.prompts_for_step = prompts_for_step
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.dropped_total = 0
        self._next_step = 0
        self._pending: deque[tuple[int, list[list[int]], Future]] = deque()

    def _submit(self) -> None:
        step = self._next_step
        prompts = self.prompts_for_step(step)
        self._pending.append((step, prompts, self.api.futures.generate(prompts, self.sampling)))
        self._next_step += 1

    def next_batch(self) -> RolloutBatch:
        """The next step's rollouts; before returning, starts generation for up to k steps ahead."""
        if not self._pending:
            self._submit()
        step, prompts, future = self._pending.popleft()
        completions = future.result()
        while len(self._pending) < self.max_staleness:
            self._submit()  # runs while the caller trains on this batch
        current = self.api.weight_version
        kept = [c for c in completions if current - c.weight_version <= self.max_staleness]
        dropped = len(completions) - len(kept)
        self.dropped_total += dropped
        staleness = max((current - c.weight_version for c in kept), default=0)
        return RolloutBatch(step=step, prompts=prompts, completions=kept, staleness=staleness, dropped=dropped)

    def wait_for_oldest(self) -> None:
        """Block until the oldest generation in flight has finished: the one holding the sampler, which a weight
        sync must wait for (a sampler that runs one call at a time takes the others after the sync)."""
        if self._pending:
            self._pending[0][2].exception()

    def wait_for_pending(self) -> None:
        """Block until generation already started has finished (before a checkpoint, say)."""
        for _, _, future in self._pending:
            future.exception()

    def close(self) -> None:
        """Wait for generation already started (its results are discarded)."""
        while self._pending:
            self._pending.popleft()[2].exception()
