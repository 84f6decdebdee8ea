"""What verl's agent loop receives from the arctic_rl rollout server is exactly what the backend's `generate`
returned: the same token ids and log-probs, for every sample of every group, against a live server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

N = 4
PROMPTS = [[1, 5, 9, 13, 17], [2, 6, 10], [3, 7, 11, 15]]


def test_samples_verl_receives_equal_the_backends_generate(server, client):
    from arctic_rl_verl.rollout import ArcticServer

    rollout = ArcticServer(SimpleNamespace(custom={"arctic": {"url": server}}, response_length=12, n=N), replica_rank=0)
    before = client.status()["backend"]["generated"]["calls"]
    # What the backend's `generate` answered, as it reached the rollout server. It is compared with what verl gets,
    # not with a second call: a sampler whose engine core batches requests as they arrive may sum a log-prob in
    # another order in another call (one ulp, seen in CI).
    answered = []
    send = rollout.client.generate

    async def recorded(prompts, params):
        completions = await send(prompts, params)
        answered.append((prompts, completions))
        return completions

    rollout.client.generate = recorded

    async def agent_loop():  # one request per sample, as verl's agent loop sends them, a group's copies together
        return await asyncio.gather(*(rollout.generate(p, {"temperature": 0.0, "top_p": 1.0, "top_k": -1}, f"{i}-{k}")
                                      for i, p in enumerate(PROMPTS) for k in range(N)))

    received = asyncio.run(agent_loop())
    assert client.status()["backend"]["generated"]["calls"] - before == 1  # the three groups in one call
    [(prompts, completions)] = answered
    assert prompts == [p for p in PROMPTS for _ in range(N)]  # in the order the agent loop sent them
    assert len(received) == len(completions) == len(PROMPTS) * N
    for output, completion in zip(received, sorted(completions, key=lambda c: c.prompt_index)):
        assert output.token_ids and len(output.log_probs) == len(output.token_ids)
        assert output.token_ids == completion.token_ids
        assert output.log_probs == completion.logprobs
