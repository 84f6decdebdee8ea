"""Scoring responses in a pool of worker processes, each response under a hard time limit.

Reward code may run model output (SQL), so it runs outside the driver's process:
a response that hangs or crashes its worker scores 0 and is counted; the worker
is replaced (pebble kills it on timeout) and the run goes on.
"""

from __future__ import annotations

import multiprocessing
import resource
import sqlite3
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from pebble import ProcessPool
from pebble.common import ProcessExpired

from arctic_rl_recipes.task import Score

WORKER_MEMORY_BYTES = 4 * 2**30
SQLITE_HEAP_BYTES = 512 * 2**20


def _limit_worker() -> None:
    """Cap a worker's address space and SQLite's heap, so a runaway query cannot take the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    conn = sqlite3.connect(":memory:")
    conn.execute(f"PRAGMA hard_heap_limit = {SQLITE_HEAP_BYTES}")  # process-wide
    conn.close()


@dataclass
class ScoreBatch:
    scores: list[Score]
    timeouts: int
    errors: int
    first_error: str | None


class RewardPool:
    def __init__(self, reward_fn: Callable[..., Score], *, workers: int, timeout_s: float):
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        # spawn, not fork: the driver holds threads and possibly a training engine.
        self._pool = ProcessPool(max_workers=workers, initializer=_limit_worker,
                                 context=multiprocessing.get_context("spawn"))

    def score(self, responses: list[str], args: list[dict[str, Any]]) -> ScoreBatch:
        futures = [self._pool.schedule(self.reward_fn, args=(r,), kwargs=a, timeout=self.timeout_s)
                   for r, a in zip(responses, args)]
        scores, timeouts, errors, first_error = [], 0, 0, None
        for future in futures:
            try:
                scores.append(future.result())
                continue
            except (FutureTimeout, ProcessExpired):
                timeouts += 1
            except Exception as err:  # a reward function's bug must not end the run; it is counted and shown
                errors += 1
                first_error = first_error or f"{type(err).__name__}: {err}"
            scores.append(Score(0.0, False))
        return ScoreBatch(scores, timeouts, errors, first_error)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()
