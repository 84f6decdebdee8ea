"""How the driver deals a call's micro-batches to trainer ranks (no Ray needed)."""

from __future__ import annotations

import random

from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.engines.rank_plan import plan_ranks
from arctic_rl_core.types import Sequence


def batch(sizes: list[int], prompt_len: int = 12, seed: int = 0) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for g, size in enumerate(sizes):
        prompt = [rng.randrange(3, 400) for _ in range(prompt_len)]
        for _ in range(size):
            n = rng.randrange(2, 9)
            seqs.append(Sequence(prompt_ids=prompt, response_ids=[rng.randrange(3, 400) for _ in range(n)],
                                 group_id=g, advantages=[1.0] * n))
    return seqs


def test_groups_stay_whole_on_one_rank_even_when_split_between_micro_batches():
    seqs = batch([6, 2, 3, 1, 5])
    for forest in (False, True):
        # a budget below the largest group's size splits it between micro-batches
        micro = build_micro_batches(seqs, token_budget=60, weight_version=0, forest=forest)
        spans = [sum(g in mb.inputs.group_index.tolist() for mb in micro) for g in range(5)]
        assert max(spans) > 1, spans
        plan = plan_ranks(micro, 2)
        owners: dict[int, set[int]] = {}
        for rank, indexes in enumerate(plan.micro_batches):
            for i in indexes:
                for g in micro[i].inputs.group_index.unique().tolist():
                    owners.setdefault(g, set()).add(rank)
        assert all(len(ranks) == 1 for ranks in owners.values()), owners
        assert sorted(i for m in plan.micro_batches for i in m) == list(range(len(micro)))
        assert plan.groups[0].isdisjoint(plan.groups[1]) and plan.groups[0] | plan.groups[1] == set(range(5))


def test_ranks_are_balanced_by_the_tokens_they_compute_and_run_equal_counts():
    seqs = batch([4, 4, 4, 4, 4, 4], prompt_len=40)
    micro = build_micro_batches(seqs, token_budget=10**6, weight_version=0, forest=True)
    assert len(micro) == 1  # one forest: a single unit
    plan = plan_ranks(micro, 2)
    assert sorted(map(len, plan.micro_batches)) == [0, 1] and sorted(plan.fillers) == [0, 1]

    micro = build_micro_batches(seqs, token_budget=250, weight_version=0, forest=True)
    plan = plan_ranks(micro, 2)
    load = [sum(int(micro[i].input_ids.numel()) for i in m) for m in plan.micro_batches]
    largest = max(int(mb.input_ids.numel()) for mb in micro)
    assert abs(load[0] - load[1]) <= largest, load
    counts = [len(m) + f for m, f in zip(plan.micro_batches, plan.fillers)]
    assert counts[0] == counts[1]
    assert int(micro[plan.filler].input_ids.numel()) == min(int(mb.input_ids.numel()) for mb in micro)
