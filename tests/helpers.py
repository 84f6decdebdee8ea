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


def sampled_distribution_logprobs(model, prompt, response, sampling) -> list[float]:
    """The reference of `logprobs_of: sampler` without truncation: each response token's log-prob under the
    distribution sampled from, built from the model's logits in vLLM's (and Hugging Face's) order: repetition
    penalty (prompt and completion tokens), then frequency and presence penalties (completion tokens so far), then
    the temperature (fp64)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    out = []
    for j, token in enumerate(response):
        z = logits[j].clone()
        seen = torch.tensor(sorted(set(prompt + response[:j])))
        penalised = z[seen]
        z[seen] = torch.where(penalised > 0, penalised / sampling["repetition_penalty"],
                              penalised * sampling["repetition_penalty"])
        counts = torch.bincount(torch.tensor(response[:j], dtype=torch.long), minlength=z.numel()).double()
        z -= sampling["frequency_penalty"] * counts + sampling["presence_penalty"] * (counts > 0).double()
        out.append(torch.log_softmax(z / sampling["temperature"], -1)[token].item())
    return out
