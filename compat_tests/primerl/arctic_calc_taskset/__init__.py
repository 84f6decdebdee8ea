"""A toy in-memory verifiers taskset: sums to compute with the `add` tool, rewarded on the final reply."""

from __future__ import annotations

import verifiers.v1 as vf

SYSTEM_PROMPT = "You are a calculator."
QUESTIONS = {"What is 2 + 2? Use the add tool.": "4", "Add 3 and 5 with the add tool.": "8"}


class SumTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def correct(self, trace) -> float:
        answer = QUESTIONS[trace.task.data.prompt]
        return float(answer in (trace.last_reply or ""))


class CalcTaskset(vf.Taskset[SumTask]):
    def load(self):
        for question in QUESTIONS:
            yield SumTask(vf.TaskData(prompt=question, system_prompt=SYSTEM_PROMPT), self.config.task)


__all__ = ["CalcTaskset"]
