"""A verifiers taskset for prime-rl's orchestrator runs: write words, rewarded by the share of the reply's
characters that are letters a-z.

The reward is dense on purpose: about half of what the tiny random model writes already scores (its byte-level
vocabulary also holds bytes that decode to nothing printable), so a few GRPO steps move it where a right-or-wrong
answer would stay at zero. The taskset exports its own harness, which verifiers uses when
the config names none: one chat turn in process through the rollout's endpoint (the harness `null` would run a uv
script that downloads its dependencies).
"""

from __future__ import annotations

from arctic_calc_harness import openai_client
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

import verifiers.v1 as vf

SYSTEM_PROMPT = "You write words."
PROMPTS = ("Write a sentence.", "Name a city.", "Describe the river.", "What is the answer?")


def letter_share(reply: str) -> float:
    return sum("a" <= c <= "z" for c in reply) / max(len(reply), 1)


class WordsTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def letters(self, trace) -> float:
        return letter_share(trace.last_reply or "")


class WordsTaskset(vf.Taskset[WordsTask]):
    def load(self):
        for prompt in PROMPTS:
            yield WordsTask(vf.TaskData(prompt=prompt, system_prompt=SYSTEM_PROMPT), self.config.task)


class OneTurnHarness(Harness[HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        await openai_client(endpoint, secret).chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["WordsTaskset", "OneTurnHarness"]
