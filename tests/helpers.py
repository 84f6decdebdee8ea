"""Batches for backend tests."""

import random

from arctic_rl_core.types import Sequence


def grpo_batch(groups=2, group_size=3, prompt_len=6, response_len=5, seed=0, vocab=400, with_behaviour=True):
    rng = random.Random(seed)
    seqs = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            n = max(1, response_len - i)
            seqs.append(
                Sequence(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    group_id=g,
                    advantages=[rng.uniform(-1, 1)] * n,
                    behaviour_logprobs=[-rng.uniform(3, 9) for _ in range(n)] if with_behaviour else None,
                    behaviour_version=0 if with_behaviour else None,
                )
            )
    return seqs
