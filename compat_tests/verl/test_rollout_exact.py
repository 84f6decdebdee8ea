"""What verl's agent loop receives from the arctic_rl rollout server is exactly what the backend's `generate`
returned: the same token ids and log-probs, for every sample of every group, against a live server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from arctic_rl_core.types import SamplingParams

N = 4
PROMPTS = [[1, 5, 9, 13, 17], [2, 6, 10], [3, 7, 11, 15]]


def test_samples_verl_receives_equal_the_backends_generate(server, client):
    from arctic_rl_verl.rollout import ArcticServer

    rollout = ArcticServer(SimpleNamespace(custom={"arctic": {"url": server}}, response_length=12, n=N), replica_rank=0)
    before = client.status()["backend"]["generated"]["calls"]

    async def agent_loop():  # one request per sample, as verl's agent loop sends them, a group's copies together
        return await asyncio.gather(*(rollout.generate(p, {"temperature": 0.0, "top_p": 1.0, "top_k": -1}, f"{i}-{k}")
                                      for i, p in enumerate(PROMPTS) for k in range(N)))

    received = asyncio.run(agent_loop())
    assert client.status()["backend"]["generated"]["calls"] - before == 1  # the three groups in one call

    direct = client.generate([p for p in PROMPTS for _ in range(N)], SamplingParams(temperature=0.0, max_tokens=12))
    assert len(received) == len(direct) == len(PROMPTS) * N
    for output, completion in zip(received, sorted(direct, key=lambda c: c.prompt_index)):
        assert output.token_ids == completion.token_ids
        assert output.log_probs == completion.logprobs
