"""How the arctic_rl rollout server batches verl's one-request-per-sample stream into `generate` calls:
a GRPO group (rollout.n copies of a prompt) is never split between two calls, even when its requests
straddle two bursts; a prompt whose group never completes still gets its answer."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from arctic_rl_core.types import Completion

# `arctic_rl_verl.rollout` imports verl, which runs the adapter's plugin as the environment stands then:
# imported in the tests, after every test module (test_training_worker selects the backend first) is collected.


class RecordingClient:
    def __init__(self):
        self.calls: list[list[tuple[int, ...]]] = []

    async def generate(self, prompts, params):
        self.calls.append([tuple(p) for p in prompts])
        return [Completion(prompt_index=i, token_ids=[7, i], logprobs=[-0.5, -0.5], finish_reason="stop",
                           weight_version=0) for i in range(len(prompts))]


@pytest.fixture
def server(monkeypatch):
    from arctic_rl_verl import rollout

    client = RecordingClient()
    monkeypatch.setattr(rollout.RolloutSettings, "from_rollout_config",
                        staticmethod(lambda config: SimpleNamespace(async_client=lambda: client)))
    return rollout.ArcticServer(SimpleNamespace(response_length=8, n=4), replica_rank=0), client


def test_a_group_straddling_two_bursts_goes_whole_into_one_generate_call(server):
    srv, client = server
    p1, p2, p3 = [1, 2, 3], [4, 5], [6, 7, 8, 9]

    async def main():
        first = [asyncio.create_task(srv.generate(p, {"temperature": 1.0}, f"a{i}")) for i, p in enumerate([p1] * 4 + [p2])]
        await asyncio.sleep(0.03)  # longer than the batching window: the burst ends with p2's group incomplete
        second = [asyncio.create_task(srv.generate(p, {"temperature": 1.0}, f"b{i}"))
                  for i, p in enumerate([p2] * 3 + [p3] * 4)]
        return await asyncio.gather(*first, *second)

    outputs = asyncio.run(main())
    assert len(outputs) == 12 and all(o.token_ids[0] == 7 for o in outputs)
    for call in client.calls:
        assert all(count % 4 == 0 for count in Counter(call).values()), client.calls
    assert Counter(p for call in client.calls for p in call) == {tuple(p1): 4, tuple(p2): 4, tuple(p3): 4}


def test_a_prompt_whose_group_never_completes_is_answered_after_the_longest_wait(server):
    from arctic_rl_verl import rollout

    srv, client = server  # e.g. validation sampling one response per prompt while rollout.n is 4

    async def main():
        return await srv.generate([1, 2, 3], {"temperature": 0.0}, "v0")

    t0 = time.monotonic()
    output = asyncio.run(main())
    waited = time.monotonic() - t0
    assert output.token_ids == [7, 0] and client.calls == [[(1, 2, 3)]]
    assert rollout.MAX_BATCH_WAIT_S <= waited < rollout.MAX_BATCH_WAIT_S + 30  # answered, not left waiting


def test_a_prompt_the_backend_refuses_fails_alone_and_says_why(server):
    from arctic_rl_core.errors import InvalidRequest

    srv, client = server
    real = client.generate

    async def refuse_long(prompts, params):  # as the backend answers a prompt past its context
        for i, p in enumerate(prompts):
            if len(p) > 5:
                raise InvalidRequest(f"prompts[{i}]", f"{len(p)} tokens + max_tokens 8 exceed the sampler's context 12")
        return await real(prompts, params)
    client.generate = refuse_long

    async def main():
        prompts = [[1, 2]] * 4 + [[9] * 7] * 4
        return await asyncio.gather(*(srv.generate(p, {"temperature": 1.0}, f"r{i}") for i, p in enumerate(prompts)),
                                    return_exceptions=True)

    outputs = asyncio.run(main())
    assert all(o.token_ids[0] == 7 for o in outputs[:4])  # the good group is answered
    for err in outputs[4:]:
        assert isinstance(err, ValueError)
        assert "arctic_rl refused a prompt of 7 tokens: 7 tokens + max_tokens 8 exceed the sampler's context 12" in str(err)

