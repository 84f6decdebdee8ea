"""The coalescer: concurrent requests of the same sampling become one sampler call, also when they trickle in
while the sampler is busy; a refused batch is retried request by request."""

import asyncio

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.serving.coalesce import Coalescer
from arctic_rl_core.types import Completion, SamplingParams


class Sampler:
    """Answers each prompt with its own first token; the first call waits for `release` (a long generation)."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []
        self.release = asyncio.Event()

    async def generate(self, prompts, sampling):
        self.calls.append(prompts)
        if len(self.calls) == 1:
            await self.release.wait()
        if any(p[0] < 0 for p in prompts):
            raise InvalidRequest("prompts", "a negative token id")
        return [Completion(prompt_index=i, token_ids=[p[0]], logprobs=[0.0], finish_reason="length",
                           weight_version=0) for i, p in enumerate(prompts)]


def run(scenario):
    return asyncio.run(scenario())


def test_requests_that_arrive_one_by_one_while_the_sampler_is_busy_go_as_one_call_after_it():
    async def scenario():
        sampler = Sampler()
        coalescer = Coalescer(sampler.generate, idle_s=0.001, max_wait_s=0.002)
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        first = asyncio.ensure_future(coalescer.generate([[1]], greedy))
        while not sampler.calls:
            await asyncio.sleep(0.001)
        later = []
        for token in range(2, 7):  # each arrives after the previous one's batch closed
            later.append(asyncio.ensure_future(coalescer.generate([[token], [token + 10]], greedy)))
            await asyncio.sleep(0.01)
        other = asyncio.ensure_future(coalescer.generate([[9]], SamplingParams(temperature=1.0, max_tokens=2)))
        await asyncio.sleep(0.01)
        sampler.release.set()
        answers = await asyncio.gather(first, *later, other)
        return sampler.calls, answers, coalescer.describe()

    calls, answers, described = run(scenario)
    assert calls[0] == [[1]]
    assert calls[1] == [[t] for token in range(2, 7) for t in (token, token + 10)]  # five requests, one call
    assert calls[2] == [[9]] and len(calls) == 3  # other sampling parameters: a call of their own
    for token, answer in zip(range(2, 7), answers[1:6]):
        assert [(c.prompt_index, c.token_ids) for c in answer] == [(0, [token]), (1, [token + 10])]
    assert described == {"requests": 7, "generate_calls": 3}


def test_a_merged_call_holds_at_most_max_prompts():
    async def scenario():
        sampler = Sampler()
        coalescer = Coalescer(sampler.generate, max_prompts=4, idle_s=0.001, max_wait_s=0.002)
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        first = asyncio.ensure_future(coalescer.generate([[1]], greedy))
        while not sampler.calls:
            await asyncio.sleep(0.001)
        later = []
        for token in range(2, 7):
            later.append(asyncio.ensure_future(coalescer.generate([[token], [token]], greedy)))
            await asyncio.sleep(0.01)
        sampler.release.set()
        await asyncio.gather(first, *later)
        return sampler.calls

    assert [len(call) for call in run(scenario)] == [1, 4, 4, 2]


def test_a_refused_batch_is_retried_request_by_request_and_only_the_bad_one_fails():
    async def scenario():
        sampler = Sampler()
        sampler.release.set()
        coalescer = Coalescer(sampler.generate, idle_s=0.05, max_wait_s=0.1)
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        return await asyncio.gather(*(coalescer.generate([[t]], greedy) for t in (3, -1, 4)),
                                    return_exceptions=True), sampler.calls

    (good, bad, also_good), calls = run(scenario)
    assert calls == [[[3], [-1], [4]], [[3]], [[-1]], [[4]]]
    assert good[0].token_ids == [3] and also_good[0].token_ids == [4]
    assert isinstance(bad, InvalidRequest) and bad.field == "prompts"
