"""The adapter's loss mapping against SkyRL's own policy-loss code, on the same tensors.

For each served `policy_loss_type` and every `loss_reduction`, alone, with the entropy bonus or with
the KL loss (k3, k1): SkyRL's value is its worker's, micro-batch by micro-batch (one sample each):
advantages scaled by `apply_loss_reduction_to_advantages_minibatch`, the `PolicyLossRegistry`
function, the entropy and KL terms (`compute_approx_kl`) weighted by the micro-batch's share. Ours is Arctic RL's `grpo` loss under the config the adapter
builds from the same SkyRL config. Values and gradients agree to fp32 precision.
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl_core.losses.grpo import GRPOConfig, grpo_loss
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_skyrl.losses import check_algorithm, loss_spec

ROWS, WIDTH, GROUP = 6, 5, 3
LENGTHS = [5, 3, 4, 2, 5, 4]
MAX_SEQ_LEN = 8


def skyrl_config(*overrides: str):
    from skyrl.train.config import SkyRLTrainConfig

    return SkyRLTrainConfig.from_cli_overrides(["trainer.micro_train_batch_size_per_gpu=1",
                                                f"trainer.algorithm.max_seq_len={MAX_SEQ_LEN}", *overrides])


def batch(seed: int):
    """A SkyRL mini-batch of two GRPO groups: right-aligned response tensors, some masked tokens, log-probs
    moved far enough from the old ones that the clips engage."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.zeros(ROWS, WIDTH)
    for row, length in enumerate(LENGTHS):
        valid[row, WIDTH - length:] = 1
    loss_mask = valid * (torch.rand(ROWS, WIDTH, generator=g) > 0.15)
    loss_mask[:, -1] = 1  # no row without a trained token
    old = -torch.rand(ROWS, WIDTH, generator=g) * 3 - 0.1
    logp = (old + torch.randn(ROWS, WIDTH, generator=g) * 0.4).clamp(max=-1e-3)
    advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH) * valid
    entropy = torch.rand(ROWS, WIDTH, generator=g) * 4
    reference = old + torch.randn(ROWS, WIDTH, generator=g) * 0.5
    return logp, old, advantages, loss_mask, entropy, reference


def skyrl_loss(cfg, logp, old, advantages, loss_mask, entropy, reference) -> torch.Tensor:
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        PolicyLossRegistry,
        apply_loss_reduction_to_advantages_minibatch,
        compute_approx_kl,
    )
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean

    algorithm = cfg.trainer.algorithm
    scaled = apply_loss_reduction_to_advantages_minibatch(
        advantages, loss_mask, algorithm.loss_reduction, micro_batch_size=1, max_seq_len=MAX_SEQ_LEN,
        prompt_boundaries=[(start, start + GROUP) for start in range(0, ROWS, GROUP)])
    loss_fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
    total = torch.zeros(())
    for row in range(ROWS):  # SkyRL's worker, one micro-batch per sample
        rows = slice(row, row + 1)
        policy_loss, _ = loss_fn(logp[rows], old[rows], scaled[rows], config=algorithm, loss_mask=loss_mask[rows],
                                 rollout_logprobs=old[rows])
        bonus = masked_mean(entropy[rows], loss_mask[rows]) * algorithm.entropy_loss_coef if algorithm.use_entropy_loss else 0
        kl = 0
        if algorithm.use_kl_loss:
            kl = masked_mean(compute_approx_kl(logp[rows], reference[rows], loss_mask=loss_mask[rows],
                                               kl_estimator_type=algorithm.kl_estimator_type), loss_mask[rows], dim=-1).mean()
        total = total + policy_loss + (kl * algorithm.kl_loss_coef - bonus) / ROWS
    return total, scaled


def arctic_loss(cfg, logp, old, scaled, loss_mask, entropy, reference) -> torch.Tensor:
    """Arctic RL's loss on the response tokens, flattened as the engine hands them to a loss."""
    spec = loss_spec(cfg)
    assert spec.post == []  # temperature 1
    take = lambda t: torch.cat([t[row, WIDTH - length:] for row, length in enumerate(LENGTHS)])
    seq_index = torch.cat([torch.full((length,), row) for row, length in enumerate(LENGTHS)])
    group_index = seq_index // GROUP
    mask = take(loss_mask)
    seq_tokens = torch.zeros(ROWS).index_add_(0, seq_index, mask)
    group_tokens = torch.zeros(ROWS // GROUP).index_add_(0, group_index, mask)
    inputs = LossInputs(loss_mask=mask, seq_index=seq_index, group_index=group_index, seq_tokens=seq_tokens,
                        group_tokens=group_tokens, num_tokens=float(mask.sum()), num_sequences=ROWS,
                        num_groups=ROWS // GROUP, weight_version=0, advantages=take(scaled),
                        behaviour_logprobs=take(old), ref_logprobs=take(reference))
    loss, _ = grpo_loss({"logprobs": take(logp), "entropy": take(entropy)}, inputs, GRPOConfig(**spec.config))
    return loss


@pytest.mark.parametrize("policy_loss", ["regular", "dual_clip", "cispo", "gspo", "sapo"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean",
                                       "token_mean_legacy"])
@pytest.mark.parametrize("terms", ["policy", "entropy", "kl-k3", "kl-k1"])
def test_loss_and_gradient_equal_skyrls(policy_loss, reduction, terms):
    overrides = [f"trainer.algorithm.policy_loss_type={policy_loss}", f"trainer.algorithm.loss_reduction={reduction}",
                 f"trainer.algorithm.use_entropy_loss={str(terms == 'entropy').lower()}",
                 "trainer.algorithm.entropy_loss_coef=0.05",
                 f"trainer.algorithm.use_kl_loss={str(terms.startswith('kl')).lower()}", "trainer.algorithm.kl_loss_coef=0.2",
                 f"trainer.algorithm.kl_estimator_type={terms[3:] if terms.startswith('kl') else 'k3'}",
                 "trainer.algorithm.eps_clip_low=0.1", "trainer.algorithm.eps_clip_high=0.15",
                 "trainer.algorithm.clip_ratio_c=1.5", "trainer.algorithm.cispo.cispo_eps_clip_low=0.3",
                 "trainer.algorithm.cispo.cispo_eps_clip_high=0.2", "trainer.algorithm.sapo.tau_pos=1.5",
                 "trainer.algorithm.sapo.tau_neg=2.5"]
    cfg = skyrl_config(*overrides)
    check_algorithm(cfg)
    logp, old, advantages, loss_mask, entropy, reference = batch(seed=len(policy_loss) * 7 + len(reduction))
    theirs_leaf, ours_leaf = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    theirs, scaled = skyrl_loss(cfg, theirs_leaf, old, advantages, loss_mask, entropy, reference)
    ours = arctic_loss(cfg, ours_leaf, old, scaled, loss_mask, entropy, reference)
    assert abs(theirs.item()) > 1e-3
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    theirs.backward()
    ours.backward()
    assert torch.allclose(ours_leaf.grad * loss_mask, theirs_leaf.grad * loss_mask, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value_clip", ["0.2", "null"])
@pytest.mark.parametrize("micro", [1, 3])
def test_value_loss_and_gradient_equal_skyrls_critic_loss(value_clip, micro):
    """The critic's `value` loss under the adapter's config against SkyRL's `ppo_critic_loss`, as its critic worker
    runs it: per micro-batch, gradients averaged over the micro-batches."""
    from arctic_rl_core.losses.value import ValueLossConfig, value_loss
    from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_critic_loss

    from arctic_rl_skyrl.losses import critic_loss_spec

    cfg = skyrl_config(f"trainer.algorithm.value_clip={value_clip}", "trainer.critic.model.path=/some/critic",
                       f"trainer.micro_train_batch_size_per_gpu={micro}", "trainer.critic_mini_batch_size=2",
                       "generator.n_samples_per_prompt=3")
    check_algorithm(cfg)
    _, old, _, loss_mask, _, _ = batch(seed=3)
    returns = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(4))
    values = old + torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(5)) * 0.5
    theirs_leaf, ours_leaf = values.clone().requires_grad_(), values.clone().requires_grad_()
    theirs, clipped = torch.zeros(()), []
    for start in range(0, ROWS, micro):  # SkyRL's critic worker: each micro-batch's loss, then grad / micro-batches
        rows = slice(start, start + micro)
        loss, clipfrac = ppo_critic_loss(theirs_leaf[rows], old[rows], returns[rows], config=cfg.trainer.algorithm,
                                         loss_mask=loss_mask[rows])
        theirs, clipped = theirs + loss / (ROWS // micro), clipped + [clipfrac]

    spec = critic_loss_spec(cfg)
    take = lambda t: torch.cat([t[row, WIDTH - length:] for row, length in enumerate(LENGTHS)])  # noqa: E731
    seq_index = torch.cat([torch.full((length,), row) for row, length in enumerate(LENGTHS)])
    mask = take(loss_mask)
    inputs = LossInputs(loss_mask=mask, seq_index=seq_index, group_index=seq_index // GROUP,
                        seq_tokens=torch.zeros(ROWS).index_add_(0, seq_index, mask),
                        group_tokens=torch.zeros(ROWS // GROUP).index_add_(0, seq_index // GROUP, mask),
                        num_tokens=float(mask.sum()), num_sequences=ROWS, num_groups=ROWS // GROUP, weight_version=0,
                        returns=take(returns), old_values=take(old))
    ours, _ = value_loss({"values": take(ours_leaf)}, inputs, ValueLossConfig(**spec.config))
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    theirs.backward()
    ours.backward()
    assert torch.allclose(ours_leaf.grad * loss_mask, theirs_leaf.grad * loss_mask, rtol=1e-5, atol=1e-7)
    if value_clip != "null":
        assert any(0 < c < 1 for c in clipped)  # the clip engaged


def test_clips_engage_in_this_batch():
    """The parity above is not vacuous: in its batch PPO's and CISPO's clips change the loss."""
    logp, old, *_ = batch(seed=1)
    ratio = (logp - old).exp()
    assert ((ratio < 0.9) | (ratio > 1.15)).float().mean() > 0.3


@pytest.mark.parametrize("override, key", [
    ("trainer.algorithm.policy_loss_type=clip_cov", "policy_loss_type"),
    ("trainer.algorithm.kl_estimator_type=k2", "kl_estimator_type"),
    ("trainer.update_ref_every_epoch=true", "update_ref_every_epoch"),
    ("trainer.critic.model.path=/some/critic trainer.critic_mini_batch_size=1 generator.n_samples_per_prompt=3 "
     "trainer.micro_train_batch_size_per_gpu=2", "micro_train_batch_size_per_gpu=2 does not divide the critic's"),
    ("trainer.critic.model.path=/some/critic generator.apply_overlong_filtering=true", "apply_overlong_filtering"),
    ("trainer.algorithm.use_kl_loss=true generator.apply_overlong_filtering=true", "apply_overlong_filtering"),
    ("trainer.algorithm.off_policy_correction.tis_ratio_type=token", "off_policy_correction"),
    ("trainer.algorithm.use_tis=true", "use_tis"),
    ("trainer.algorithm.enable_sample_support_replay=true "
     "generator.inference_engine.enable_return_sample_support_set=true generator.sampling_params.top_k=20",
     "enable_sample_support_replay"),
])
def test_settings_the_backend_would_not_honour_are_refused_by_name(override, key):
    with pytest.raises(ArcticSetupError, match=key.replace(".", r"\.")):
        check_algorithm(skyrl_config(*override.split()))


def test_an_entropy_bonus_tied_to_skyrls_micro_batching_is_refused():
    cfg = skyrl_config("trainer.algorithm.use_entropy_loss=true", "trainer.micro_train_batch_size_per_gpu=2",
                       "trainer.policy_mini_batch_size=2", "generator.n_samples_per_prompt=4")
    with pytest.raises(ArcticSetupError, match="micro_train_batch_size_per_gpu=2"):
        check_algorithm(cfg)
