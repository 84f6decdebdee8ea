"""Micro-batch planning and the response-position layout."""

import pytest
import torch

from arctic_rl_core.batching import build_micro_batches, group_indices, plan_micro_batches
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.losses.grpo import loglinear_proximal
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


def test_a_response_sampled_across_a_sync_gives_the_loss_each_tokens_version():
    crossed = seq(2, 4).model_copy(update={"behaviour_versions": [3, 3, 4, 4]})
    whole = seq(2, 2).model_copy(update={"behaviour_version": 4})
    [mb] = build_micro_batches([crossed, whole], token_budget=100, weight_version=5)
    assert mb.inputs.behaviour_version.tolist() == [3.0, 3.0, 4.0, 4.0, 4.0, 4.0]
    # the staleness-aware proximal policy is interpolated per token: 2 versions behind, then 1 (no interpolation)
    logp, old = torch.zeros(6), torch.full((6,), -1.0)
    prox = loglinear_proximal(logp, old, mb.inputs.behaviour_version, current_version=5)
    assert prox.tolist() == [-0.5, -0.5, -1.0, -1.0, -1.0, -1.0]


@pytest.mark.parametrize("update, field, message", [
    ({"behaviour_versions": [1, 2]}, "s[0].behaviour_versions", "has 2 entries but response_ids has 3"),
    ({"behaviour_versions": [1, 1, 2], "behaviour_version": 1}, "s[0].behaviour_versions", "not both"),
    ({"behaviour_versions": [1, -1, 2]}, "s[0].behaviour_versions", "versions must be in [0, "),
])
def test_per_token_versions_are_checked_by_field(update, field, message):
    with pytest.raises(InvalidRequest) as err:
        Sequence(**{**seq(2, 3).model_dump(), **update}).check("s[0]")
    assert err.value.field == field and message in err.value.message
