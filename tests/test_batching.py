"""Micro-batch planning and the response-position layout."""

import torch

from arctic_rl_core.batching import build_micro_batches, group_indices, plan_micro_batches
from arctic_rl_core.types import Sequence


def seq(p, r, group=None):
    return Sequence(prompt_ids=list(range(1, p + 1)), response_ids=list(range(100, 100 + r)), group_id=group)


def test_groups_stay_whole_and_oversize_groups_split_between_sequences():
    seqs = [seq(4, 2, "a"), seq(4, 2, "a"), seq(4, 2, "b"), seq(4, 2, "b"), seq(4, 2, "b"), seq(4, 2)]
    groups = group_indices(seqs)
    assert groups == [0, 0, 1, 1, 1, 2]
    # budget 18 padded tokens = 3 sequences of 6
    plan = plan_micro_batches(seqs, groups, token_budget=18)
    assert plan == [[0, 1], [2, 3, 4], [5]]
    # budget 12 = 2 sequences: group b (3 sequences) must be split, between sequences
    plan = plan_micro_batches(seqs, groups, token_budget=12)
    assert plan == [[0, 1], [2, 3], [4, 5]]
    assert sorted(i for mb in plan for i in mb) == list(range(6))


def test_logit_rows_point_at_the_positions_that_predict_each_response_token():
    seqs = [seq(3, 2), seq(1, 3)]
    [mb] = build_micro_batches(seqs, token_budget=100, weight_version=4)
    assert mb.input_ids.tolist() == [[1, 2, 3, 100, 101], [1, 100, 101, 102, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # row 0: positions 2, 3 predict tokens 100, 101; row 1 (offset 5): positions 0, 1, 2
    assert mb.logit_rows.tolist() == [2, 3, 5, 6, 7]
    assert mb.targets.tolist() == [100, 101, 100, 101, 102]
    assert mb.inputs.weight_version == 4 and mb.inputs.num_tokens == 5


def test_batch_wide_denominators_are_shared_by_all_micro_batches():
    seqs = [seq(2, 3, "g"), seq(2, 1, "g"), seq(2, 2)]
    seqs[0] = seqs[0].model_copy(update={"loss_mask": [1.0, 0.0, 1.0]})
    mbs = build_micro_batches(seqs, token_budget=5, weight_version=0)
    assert len(mbs) == 3
    for mb in mbs:
        assert mb.inputs.num_tokens == 5.0 and mb.inputs.num_sequences == 3 and mb.inputs.num_groups == 2
        assert torch.equal(mb.inputs.seq_tokens, torch.tensor([2.0, 1.0, 2.0]))
        assert torch.equal(mb.inputs.group_tokens, torch.tensor([3.0, 2.0]))
