"""Every loss term against values computed by hand on small tensors."""

import math

import pytest
import torch

from arctic_rl_core.losses.grpo import GRPOConfig, grpo_loss, kl_penalty, loglinear_proximal, m2po_keep_mask
from arctic_rl_core.losses.importance_sampling import ImportanceSamplingConfig, importance_sampling_loss
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.post_processors import TemperatureConfig, apply_temperature, compute_entropy, compute_logprobs
from arctic_rl_core.losses.sft import SFTConfig, sft_loss


def make_inputs(seq_index, group_index=None, mask=None, version=0, **fields):
    seq_index = torch.tensor(seq_index)
    group_index = torch.tensor(group_index) if group_index is not None else seq_index.clone()
    mask = torch.tensor(mask, dtype=torch.float32) if mask is not None else torch.ones(len(seq_index))
    seq_tokens = torch.zeros(int(seq_index.max()) + 1).index_add_(0, seq_index, mask)
    group_tokens = torch.zeros(int(group_index.max()) + 1).index_add_(0, group_index, mask)
    tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in fields.items()}
    return LossInputs(
        loss_mask=mask, seq_index=seq_index, group_index=group_index, seq_tokens=seq_tokens, group_tokens=group_tokens,
        num_tokens=float(mask.sum()), num_sequences=int((seq_tokens > 0).sum()), num_groups=int((group_tokens > 0).sum()),
        weight_version=version, **tensors,
    )


def logp_leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


@pytest.mark.parametrize(
    "mode, groups, expected",
    [
        ("token-mean", [0, 0, 0, 1], 10 / 4),
        ("seq-mean-token-mean", [0, 0, 0, 1], (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum", [0, 0, 0, 1], (6 + 4) / 2),
        ("prompt-mean", [0, 0, 0, 1], (2 + 4) / 2),
        ("prompt-mean", [0, 0, 0, 0], 10 / 4),
        ("token-sum", [0, 0, 0, 1], 10),
    ],
)
def test_aggregation_modes(mode, groups, expected):
    seq = [0, 0, 0, 1]
    group_of_seq = {s: g for s, g in zip(seq, groups)}
    inputs = make_inputs(seq, [group_of_seq[s] for s in seq])
    assert inputs.aggregate(torch.tensor([1.0, 2.0, 3.0, 4.0]), mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_every_term_so_aggregated_by_the_scale_factor():
    # verl's seq-mean-token-sum-norm (Dr. GRPO): per-sequence sums, mean over sequences, / loss_scale_factor.
    inputs = make_inputs([0, 0, 0, 1])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert inputs.aggregate(values, "seq-mean-token-sum-norm", 8.0).item() == pytest.approx((6 + 4) / 2 / 8)
    logp = logp_leaf([-1.0] * 4)
    entropy = torch.tensor([2.0, 4.0, 4.0, 4.0])
    fields = make_inputs([0, 0, 0, 1], behaviour_logprobs=[-1.0] * 4, advantages=[1.0, 1.0, 1.0, -2.0])
    config = GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4.0, entropy_coeff=0.1,
                        entropy_agg_mode="token-mean")
    loss, _ = grpo_loss({"logprobs": logp, "entropy": entropy}, fields, config)
    # pg = -A per token at ratio 1: sequences sum to -3 and +2; entropy by token mean: 14 / 4.
    assert loss.item() == pytest.approx((-3 + 2) / 2 / 4 - 0.1 * 14 / 4, rel=1e-6)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm")


def test_masked_tokens_leave_numerator_and_denominator():
    inputs = make_inputs([0, 0, 1], mask=[1, 0, 1])
    assert inputs.aggregate(torch.tensor([1.0, 100.0, 3.0]), "token-mean").item() == pytest.approx(2.0)
    assert inputs.aggregate(torch.tensor([1.0, 100.0, 3.0]), "seq-mean-token-mean").item() == pytest.approx(2.0)


def test_sft_is_token_mean_negative_log_likelihood():
    logp = logp_leaf([math.log(0.5), math.log(0.25), math.log(0.125)])
    loss, metrics = sft_loss({"logprobs": logp}, make_inputs([0, 0, 1]), SFTConfig())
    assert loss.item() == pytest.approx((math.log(2) + math.log(4) + math.log(8)) / 3, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((3,), -1 / 3))


def ratios_setup(ratios, advantages, **config):
    old = [math.log(0.5)] * len(ratios)
    logp = logp_leaf([math.log(0.5 * r) for r in ratios])
    inputs = make_inputs(list(range(len(ratios))), advantages=advantages, behaviour_logprobs=old)
    loss, metrics = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(**config))
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_ppo_clip_with_clip_higher():
    # r=1.5,A=1 -> -1.28 (clipped at 1+0.28); r=0.5,A=-1 -> 0.8 (clipped at 1-0.2);
    # r=1.1,A=1 -> -1.1 (inside); r=0.7,A=-1 -> 0.8 (clipped)
    loss, metrics, grad = ratios_setup([1.5, 0.5, 1.1, 0.7], [1.0, -1.0, 1.0, -1.0], eps_clip=0.2, eps_clip_higher=0.28)
    assert loss == pytest.approx((-1.28 + 0.8 - 1.1 + 0.8) / 4, rel=1e-5)
    assert float(metrics["clip_frac"]) == pytest.approx(0.75)
    # Only the unclipped token has a gradient: d(-A r)/dlogp = -A r
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, -1.1 / 4, 0.0]), atol=1e-6)


def test_symmetric_clip_is_default():
    loss, _, _ = ratios_setup([1.5], [1.0], eps_clip=0.2)
    assert loss == pytest.approx(-1.2, rel=1e-5)


def test_dual_clip_bounds_negative_advantage_loss():
    # r=5, A=-1: PPO loss max(5, 1.28)=5, dual clip caps it at -A*c = 3; its gradient is zero.
    loss, metrics, grad = ratios_setup([5.0], [-1.0], eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0)
    assert loss == pytest.approx(3.0, rel=1e-5)
    assert float(metrics["dual_clip_frac"]) == 1.0
    assert grad.abs().max() == 0
    # Without dual clip the same token costs 5 with gradient -A r = 5.
    loss, _, grad = ratios_setup([5.0], [-1.0], eps_clip=0.2, eps_clip_higher=0.28)
    assert loss == pytest.approx(5.0, rel=1e-5)
    assert grad.item() == pytest.approx(5.0, rel=1e-5)


def test_on_policy_without_behaviour_logprobs_is_reinforce():
    logp = logp_leaf([-1.0, -2.0])
    inputs = make_inputs([0, 0], advantages=[2.0, -1.0])
    loss, _ = grpo_loss({"logprobs": logp}, inputs, GRPOConfig())
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    assert torch.allclose(logp.grad, torch.tensor([-1.0, 0.5]))


@pytest.mark.parametrize("kind, expected", [("k1", math.log(2)), ("k3", 0.5 + math.log(2) - 1), ("low_var_kl", 0.5 + math.log(2) - 1)])
def test_kl_penalty_values(kind, expected):
    assert kl_penalty(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), kind).item() == pytest.approx(expected, rel=1e-6)


def test_kl_term_is_added_with_its_coefficient():
    logp = logp_leaf([math.log(0.5)])
    inputs = make_inputs([0], advantages=[0.0], ref_logprobs=[math.log(0.25)])
    loss, metrics = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(kl_loss_coef=0.1, kl_loss_type="k1"))
    assert loss.item() == pytest.approx(0.1 * math.log(2), rel=1e-6)
    assert float(metrics["kl"]) == pytest.approx(math.log(2), rel=1e-6)


def test_entropy_bonus_is_subtracted():
    logp = logp_leaf([-1.0, -1.0])
    entropy = torch.tensor([2.0, 4.0])
    inputs = make_inputs([0, 0], advantages=[0.0, 0.0])
    loss, metrics = grpo_loss({"logprobs": logp, "entropy": entropy}, inputs, GRPOConfig(entropy_coeff=0.01))
    assert loss.item() == pytest.approx(-0.01 * 3.0, rel=1e-6)
    assert float(metrics["entropy"]) == pytest.approx(3.0)


def test_entropy_bonus_can_be_aggregated_apart_from_the_policy_term():
    # Sequences of 1 and 3 tokens: the policy term summed (token-sum), the bonus per sequence (SkyRL's, for
    # micro-batches of one sample): (2 + (4 + 4 + 4) / 3) / 2 = 3 against a token mean of 14 / 4.
    logp = logp_leaf([-1.0, -1.0, -1.0, -1.0])
    entropy = torch.tensor([2.0, 4.0, 4.0, 4.0])
    inputs = make_inputs([0, 1, 1, 1], behaviour_logprobs=[-1.0] * 4, advantages=[0.5, 0.25, 0.25, 0.25])
    config = GRPOConfig(loss_agg_mode="token-sum", entropy_coeff=0.1, entropy_agg_mode="seq-mean-token-mean")
    loss, _ = grpo_loss({"logprobs": logp, "entropy": entropy}, inputs, config)
    assert loss.item() == pytest.approx(-(0.5 + 3 * 0.25) - 0.1 * 3.0, rel=1e-6)


def test_cispo_uses_stopped_clipped_weight_times_logp_gradient():
    loss, metrics, grad = ratios_setup([2.0, 0.5], [1.0, 1.0], use_cispo_loss=True, is_weight_clip_max=1.5)
    lp = [math.log(1.0), math.log(0.25)]
    assert loss == pytest.approx((-1.5 * lp[0] - 0.5 * lp[1]) / 2, rel=1e-5)
    assert torch.allclose(grad, torch.tensor([-1.5 / 2, -0.5 / 2]), atol=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)


def test_m2po_masks_largest_second_moments_until_mean_below_threshold():
    keep = m2po_keep_mask(torch.tensor([4.0, 1.0, 0.25, 0.01]), torch.ones(4), threshold=0.5)
    assert keep.tolist() == [0.0, 1.0, 1.0, 1.0]  # mean of the rest: 0.42 < 0.5
    keep = m2po_keep_mask(torch.tensor([4.0, 1.0, 0.25, 0.01]), torch.ones(4), threshold=0.3)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0]  # 0.42 >= 0.3, then 0.13 < 0.3
    keep = m2po_keep_mask(torch.tensor([0.1, 0.2]), torch.ones(2), threshold=0.5)
    assert keep.tolist() == [1.0, 1.0]


def test_m2po_in_loss_drops_tokens_but_keeps_denominator():
    # (logp - old)^2 = [4, 1, 0.25, 0.01]; A = 0 except token 1, so the loss reads token 1 only.
    old = [-3.0, -3.0, -3.0, -3.0]
    logp = logp_leaf([-1.0, -2.0, -2.5, -2.9])
    inputs = make_inputs([0, 0, 0, 0], advantages=[5.0, 1.0, 0.0, 0.0], behaviour_logprobs=old)
    loss, metrics = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(m2_threshold=0.5, eps_clip=10.0))
    ratio1 = math.exp(-2.0 + 3.0)
    assert loss.item() == pytest.approx(-ratio1 / 4, rel=1e-5)
    assert float(metrics["m2po_masked_frac"]) == pytest.approx(0.25)


def test_decoupled_recompute_uses_proximal_and_behaviour_weight():
    old, prox = math.log(0.5), math.log(0.6)
    logp = logp_leaf([math.log(0.6)])
    inputs = make_inputs([0], advantages=[1.0], behaviour_logprobs=[old], proximal_logprobs=[prox])
    loss, _ = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(use_decoupled_loss=True))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, rel=1e-5)  # ratio 1, behaviour weight 0.6/0.5
    assert logp.grad.item() == pytest.approx(-1.2, rel=1e-5)
    loss, metrics = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(use_decoupled_loss=True, behav_imp_weight_cap=1.1))
    assert loss.item() == 0.0
    assert float(metrics["behav_capped_frac"]) == 1.0


def test_decoupled_recompute_without_proximal_uses_current_policy():
    old = math.log(0.5)
    logp = logp_leaf([math.log(0.6)])
    inputs = make_inputs([0], advantages=[1.0], behaviour_logprobs=[old])
    loss, _ = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(use_decoupled_loss=True))
    assert loss.item() == pytest.approx(-1.2, rel=1e-5)


def test_loglinear_proximal_interpolates_by_staleness():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    old = torch.tensor([-3.0, -3.0, -3.0, -3.0])
    prox = loglinear_proximal(logp, old, torch.tensor([5.0, 4.0, 3.0, 1.0]), current_version=5)
    # staleness 0, 1, 2, 4 -> alpha 0, 0, 1/2, 3/4
    assert torch.allclose(prox, torch.tensor([-3.0, -3.0, -2.0, -1.5]))


def test_loglinear_in_loss_uses_engine_version_by_default():
    logp = logp_leaf([-1.0])
    inputs = make_inputs([0], version=3, advantages=[1.0], behaviour_logprobs=[-3.0], behaviour_version=[1.0])
    loss, _ = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(use_decoupled_loss=True, prox_logp_method="loglinear", eps_clip=100))
    # alpha = 1/2: prox = -2; ratio = e^1; behaviour weight = e^1
    assert loss.item() == pytest.approx(-math.e * math.e, rel=1e-5)


def test_importance_sampling_loss():
    logp = logp_leaf([math.log(0.6), math.log(0.2)])
    inputs = make_inputs([0, 1], advantages=[1.0, -2.0], behaviour_logprobs=[math.log(0.5), math.log(0.4)])
    loss, _ = importance_sampling_loss({"logprobs": logp}, inputs, ImportanceSamplingConfig())
    assert loss.item() == pytest.approx((-1.2 + 2 * 0.5) / 2, rel=1e-5)


def test_losses_add_up_over_micro_batches():
    """A loss on two halves with batch-wide denominators equals the loss on the whole."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3])
    fields = dict(advantages=[1.0, -1.0, 0.5, 2.0, -0.5], behaviour_logprobs=[-1.1, -0.4, -2.2, -0.2, -0.3])
    whole = make_inputs([0, 0, 1, 2, 2], [0, 0, 0, 1, 1], **fields)
    config = GRPOConfig(loss_agg_mode="seq-mean-token-mean")
    full, _ = grpo_loss({"logprobs": logp}, whole, config)
    parts = 0.0
    for sl in (slice(0, 3), slice(3, 5)):
        part = LossInputs(**{k: (v[sl] if isinstance(v, torch.Tensor) and v.shape == logp.shape else v) for k, v in vars(whole).items()})
        parts += grpo_loss({"logprobs": logp[sl]}, part, config)[0].item()
    assert parts == pytest.approx(full.item(), rel=1e-6)


def test_post_processors_temperature_logprobs_entropy():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    targets = torch.tensor([1, 0])
    out = {"logits": logits, "targets": targets}
    out.update(apply_temperature(out, None, TemperatureConfig(temperature=0.5)))
    out.update(compute_logprobs(out, None, None))
    out.update(compute_entropy(out, None, None))
    # temperature 0.5 squares the odds: p(1) = 9/10
    assert out["logprobs"][0].item() == pytest.approx(math.log(0.9), rel=1e-6)
    assert out["logprobs"][1].item() == pytest.approx(math.log(0.5), rel=1e-6)
    assert out["entropy"][1].item() == pytest.approx(math.log(2), rel=1e-6)


def test_gspo_takes_each_sequences_geometric_mean_ratio_with_per_token_gradients():
    # Sequence 0: log-ratios ln 2 and 0 -> ratio sqrt(2) at both tokens, clipped at 1.2 (no gradient); sequence 1:
    # ratio 1, gradient -A/3 through its own token only.
    old = [math.log(0.25), math.log(0.5), math.log(0.5)]
    logp = logp_leaf([math.log(0.5), math.log(0.5), math.log(0.5)])
    inputs = make_inputs([0, 0, 1], advantages=[1.0, 1.0, 1.0], behaviour_logprobs=old)
    loss, metrics = grpo_loss({"logprobs": logp}, inputs, GRPOConfig(importance_ratio="sequence"))
    assert loss.item() == pytest.approx((-1.2 - 1.2 - 1.0) / 3, rel=1e-6)
    assert float(metrics["ratio_mean"]) == pytest.approx((2 * math.sqrt(2) + 1) / 3, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.0, -1 / 3]), atol=1e-7)
    with pytest.raises(ValueError, match="GSPO"):
        GRPOConfig(importance_ratio="sequence", use_cispo_loss=True)


def test_cispo_with_equal_bounds_is_the_plain_policy_gradient():
    """verl's gpg: a stopped weight of exactly 1, so the loss is -A logp whatever the ratio."""
    loss, _, grad = ratios_setup([2.0, 0.5], [1.0, -1.0], use_cispo_loss=True, is_weight_clip_min=1.0,
                                 is_weight_clip_max=1.0)
    lp = [math.log(1.0), math.log(0.25)]
    assert loss == pytest.approx((-lp[0] + lp[1]) / 2, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([-0.5, 0.5]), atol=1e-7)
    with pytest.raises(ValueError, match="is_weight_clip_min must not be above"):
        GRPOConfig(use_cispo_loss=True, is_weight_clip_min=2.0, is_weight_clip_max=1.0)


def test_gmpo_is_the_mean_over_sequences_of_minus_the_mean_advantage_times_the_geometric_mean_ratio():
    from arctic_rl_core.losses.gmpo import GMPOConfig, gmpo_loss

    # Sequence 0 (A = 1): log-ratios 0.8 (clipped to 0.4) and 0 -> ratio e^0.2. Sequence 1 (A = -1): log-ratio -0.8,
    # s*d = 0.8 against s*d_clip = 0.4: the clipped one is smaller -> m = -0.4, ratio e^-0.4.
    old = [-1.0, -1.0, -1.0]
    logp = logp_leaf([-0.2, -1.0, -1.8])
    inputs = make_inputs([0, 0, 1], advantages=[1.0, 1.0, -1.0], behaviour_logprobs=old)
    loss, metrics = gmpo_loss({"logprobs": logp}, inputs, GMPOConfig(eps_clip=0.4))
    assert loss.item() == pytest.approx((-math.exp(0.2) + math.exp(-0.4)) / 2, rel=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 3)
    loss.backward()
    # Only unclipped tokens carry gradient: token 1 of sequence 0 (d/dlogp = -e^0.2 / 2 / 2).
    assert torch.allclose(logp.grad, torch.tensor([0.0, -math.exp(0.2) / 4, 0.0]), atol=1e-6)


def test_sapo_gates_the_ratio_softly_by_the_advantages_sign():
    # r = 2 with A = 1 (tau 1): -sigmoid(1) * 4; r = 0.5 with A = -1 (tau 2): sigmoid(-1) * 2. Token mean.
    loss, metrics, grad = ratios_setup([2.0, 0.5], [1.0, -1.0], sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert loss == pytest.approx((-sig(1.0) * 4 + sig(-1.0) * 2) / 2, rel=1e-6)
    # d/dlogp = -A * sigmoid'(tau (r - 1)) * tau * r * 4 / tau, halved by the token mean.
    expected = [-1 * sig(1) * (1 - sig(1)) * 2 * 4 / 2, 1 * sig(-1) * (1 - sig(-1)) * 0.5 * 4 / 2]
    assert torch.allclose(grad, torch.tensor(expected), atol=1e-6)
    with pytest.raises(ValueError, match="both"):
        GRPOConfig(sapo_tau_pos=1.0)
    with pytest.raises(ValueError, match="c_clip is PPO's dual clip .*not with sapo_tau_pos"):
        GRPOConfig(sapo_tau_pos=1.0, sapo_tau_neg=1.0, c_clip=3.0)


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    # -(A logp - beta/2 (log r)^2), token mean; gradient -(A - beta log r) / 2.
    loss, metrics, grad = ratios_setup([2.0, 0.5], [1.0, -1.0], dro_beta=0.5)
    lp = [math.log(1.0), math.log(0.25)]
    penalty = 0.25 * math.log(2.0) ** 2
    assert loss == pytest.approx((-(lp[0] - penalty) - (-lp[1] - penalty)) / 2, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([-(1 - 0.5 * math.log(2)) / 2, -(-1 + 0.5 * math.log(2)) / 2]), atol=1e-6)
    assert float(metrics["clip_frac"]) == 0
    with pytest.raises(ValueError, match="dro_beta and use_cispo_loss|use_cispo_loss and dro_beta"):
        GRPOConfig(dro_beta=0.1, use_cispo_loss=True)


def test_dppo_tv_drops_tokens_whose_probability_moved_past_the_bound_in_the_advantages_direction():
    # Old p = 0.5. p 0.75 with A > 0 moved +0.25 > 0.2: dropped; p 0.6 moved +0.1: kept with weight 1.2;
    # p 0.25 with A < 0 moved -0.25: dropped; p 0.4 kept with weight 0.8. Each kept token: -w A logp.
    loss, metrics, grad = ratios_setup([1.5, 1.2, 0.5, 0.8], [1.0, 1.0, -1.0, -1.0], dppo_divergence="tv", c_clip=3.0)
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.8 * math.log(0.4)) / 4, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([0.0, -1.2 / 4, 0.0, 0.8 / 4]), atol=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)


def test_dppo_binary_kl_bounds_the_divergence_of_the_tokens_bernoulli_and_truncates_the_weight():
    # p 0.5 -> 0.75 (A > 0): binary KL 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.1438 > 0.1, dropped; p 0.5 -> 0.25
    # with A > 0 moves against the advantage: kept whatever its divergence.
    loss, metrics, grad = ratios_setup([1.5, 0.5], [1.0, 1.0], dppo_divergence="binary_kl", eps_clip=0.1, c_clip=3.0)
    assert loss == pytest.approx(-0.5 * math.log(0.25) / 2, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([0.0, -0.5 / 2]), atol=1e-6)
    loss, _, _ = ratios_setup([1.5, 0.5], [1.0, 1.0], dppo_divergence="binary_kl", eps_clip=0.2, c_clip=3.0)
    assert loss == pytest.approx((-1.5 * math.log(0.75) - 0.5 * math.log(0.25)) / 2, rel=1e-6)
    # A ratio of 1.9 (p 0.95) truncated at c_clip 1.5: weight 1.5, counted in dual_clip_frac.
    loss, metrics, grad = ratios_setup([1.9], [1.0], dppo_divergence="tv", eps_clip=0.5, c_clip=1.5)
    assert loss == pytest.approx(-1.5 * math.log(0.95), rel=1e-6)
    assert float(metrics["dual_clip_frac"]) == 1.0


def test_importance_weights_multiply_each_tokens_policy_gradient_term():
    old = [math.log(0.5)] * 2
    logp = logp_leaf([math.log(0.5)] * 2)
    inputs = make_inputs([0, 1], advantages=[1.0, -1.0], behaviour_logprobs=old, is_weights=[2.0, 0.5],
                         ref_logprobs=[math.log(0.25)] * 2)
    config = GRPOConfig(kl_loss_coef=0.1, kl_loss_type="k1")
    loss, _ = grpo_loss({"logprobs": logp}, inputs, config)
    # On policy: pg = -A at ratio 1, weighted; the KL term is not weighted.
    assert loss.item() == pytest.approx((-2.0 + 0.5) / 2 + 0.1 * math.log(2), rel=1e-6)


def test_primerl_default_masks_by_probability_moved_in_the_advantage_direction_and_keeps_the_kl_term():
    """prime-rl's DPPO-Binary-TV + KL on four tokens sampled at p = 0.5 (its own parity test is in compat_tests/primerl).
    p: 0.8 with A = 1 (moved up 0.3 > 0.2: masked), 0.6 with A = 1 (kept), 0.2 with A = -1 (moved down 0.3: masked),
    0.45 with A = -1, loss-masked out."""
    from arctic_rl_core.losses.primerl import PrimeRLDefaultConfig, primerl_default_loss

    p = [0.8, 0.6, 0.2, 0.45]
    logp = logp_leaf([math.log(x) for x in p])
    inputs = make_inputs([0, 0, 1, 1], mask=[1, 1, 1, 0], advantages=[1.0, 1.0, -1.0, -1.0],
                         behaviour_logprobs=[math.log(0.5)] * 4)
    loss, metrics = primerl_default_loss({"logprobs": logp}, inputs, PrimeRLDefaultConfig(kl_tau=0.1))
    l = [math.log(x / 0.5) for x in p]
    expected = (-1.2 + 0.1 * (l[0] ** 2 + l[1] ** 2 + l[2] ** 2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert float(metrics["is_masked"]) == pytest.approx(2 / 3)
    assert float(metrics["is_masked_high"]) == pytest.approx(1 / 3)
    assert float(metrics["is_masked_low"]) == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp: -A r on kept tokens, 2 kl_tau l everywhere trained, over 3 tokens; nothing for the masked-out one.
    grad = [0.2 * l[0] / 3, (-1.2 + 0.2 * l[1]) / 3, 0.2 * l[2] / 3, 0.0]
    assert torch.allclose(logp.grad, torch.tensor(grad), atol=1e-6)


def test_primerl_ipo_masks_by_the_absolute_move_whatever_the_advantage():
    from arctic_rl_core.losses.primerl import PrimeRLIPOConfig, primerl_ipo_loss

    p = [0.65, 0.55, 0.35]  # moved 0.15 (masked at 0.1), 0.05 (kept), 0.15 (masked)
    logp = logp_leaf([math.log(x) for x in p])
    inputs = make_inputs([0, 1, 2], advantages=[1.0, -2.0, -1.0], behaviour_logprobs=[math.log(0.5)] * 3)
    loss, metrics = primerl_ipo_loss({"logprobs": logp}, inputs, PrimeRLIPOConfig(adv_tau=0.5, kl_tau=0.0))
    assert loss.item() == pytest.approx(0.5 * 2.0 * 1.1 / 3, rel=1e-6)
    assert float(metrics["is_masked"]) == pytest.approx(2 / 3)
