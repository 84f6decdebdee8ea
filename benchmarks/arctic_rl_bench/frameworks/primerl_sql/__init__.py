"""`bench frameworks`' workload as a verifiers taskset, for prime-rl's env server: the prompts the runner wrote
(`ARCTIC_RL_BENCH_PROMPTS`, a JSON list of [user message, answer]), rewarded as the other frameworks' columns are
(1 for a reply holding the answer's first digit: `workload.REWARD`). One chat turn in process, through the harness of
compat_tests/primerl's taskset (on the env server's PYTHONPATH).
"""

from __future__ import annotations

import json
import os

import verifiers.v1 as vf
from arctic_letters import OneTurnHarness


class SqlData(vf.TaskData):
    answer: str = ""


class SqlTask(vf.Task[SqlData]):
    @vf.reward
    async def first_digit(self, trace) -> float:
        return float(self.data.answer[:1] in (trace.last_reply or ""))


class SqlTaskset(vf.Taskset[SqlTask]):
    def load(self):
        with open(os.environ["ARCTIC_RL_BENCH_PROMPTS"]) as f:
            for content, answer in json.load(f):
                yield SqlTask(SqlData(prompt=content, answer=answer), self.config.task)


__all__ = ["SqlTaskset", "OneTurnHarness"]
