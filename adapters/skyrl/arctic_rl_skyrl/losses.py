"""SkyRL's policy-loss settings (`trainer.algorithm.*`) as Arctic RL's GRPO loss, or a refusal by name.

SkyRL applies its loss reduction by scaling the advantages of each mini-batch
(`apply_loss_reduction_to_advantages_minibatch`) and then sums the per-token losses, so the
backend sums too (`token-sum`) over the advantages it is sent: every `loss_reduction` is
reproduced exactly. Its KL loss (against the job's reference model) is a per-sequence mean. Its entropy bonus is a mean over micro-batches of each one's token mean,
which is a per-sequence mean for micro-batches of one sample and a token mean for a micro-batch
holding the whole mini-batch; any other split would tie the loss to SkyRL's micro-batching and
is refused.
"""

from __future__ import annotations

from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_core.types import LossSpec

ALGORITHM = "trainer.algorithm"
SERVED_POLICY_LOSSES = ("regular", "dual_clip", "cispo", "gspo", "sapo")
KL_ESTIMATORS = {"k1": "k1", "k3": "k3"}
"""SkyRL's `kl_estimator_type` -> the backend's `kl_loss_type` (the same formulas, k3 with the same clamp)."""


def uses_reference(cfg) -> bool:
    """Whether SkyRL's trainer asks for reference log-probs (its KL loss or KL reward penalty)."""
    return bool(cfg.trainer.algorithm.use_kl_loss or cfg.trainer.algorithm.use_kl_in_reward)


def uses_critic(cfg) -> bool:
    """Whether SkyRL holds a critic (GAE and other value-based advantage estimators)."""
    return bool(cfg.trainer.critic.model.path)


def _off_policy_correction_on(opc) -> bool:
    return (opc.tis_ratio_type is not None or opc.sequence_mask_metric is not None
            or opc.outlier_token_is_threshold_low is not None or opc.outlier_token_is_threshold_high is not None
            or opc.token_mask_is_threshold_low is not None or opc.token_mask_is_threshold_high is not None)


def check_algorithm(cfg) -> None:
    """Refuse, at start-up and by key, every setting the backend would not honour."""
    algorithm = cfg.trainer.algorithm
    if algorithm.policy_loss_type not in SERVED_POLICY_LOSSES:
        raise ArcticSetupError(f"{ALGORITHM}.policy_loss_type={algorithm.policy_loss_type!r}: Arctic RL serves "
                               f"{', '.join(SERVED_POLICY_LOSSES)}")
    if uses_reference(cfg) and algorithm.kl_estimator_type not in KL_ESTIMATORS:
        raise ArcticSetupError(f"{ALGORITHM}.kl_estimator_type={algorithm.kl_estimator_type!r}: the backend's KL "
                               f"term serves {', '.join(KL_ESTIMATORS)}")
    if cfg.trainer.update_ref_every_epoch:
        raise ArcticSetupError("trainer.update_ref_every_epoch: the Arctic RL job's reference model is frozen")
    if uses_critic(cfg) and cfg.trainer.max_tokens_per_microbatch <= 0:
        rows = cfg.trainer.critic_mini_batch_size * cfg.generator.n_samples_per_prompt
        micro = cfg.trainer.micro_train_batch_size_per_gpu
        if rows % micro or cfg.generator.step_wise_trajectories:
            # SkyRL averages its micro-batches' per-sequence means: a short last micro-batch weighs its rows more.
            raise ArcticSetupError(f"trainer.micro_train_batch_size_per_gpu={micro} does not divide the critic's "
                                   f"mini-batch of {rows} rows: SkyRL's value loss then depends on its micro-batching")
    if cfg.generator.apply_overlong_filtering and (uses_critic(cfg) or algorithm.use_kl_loss):
        # It zeroes whole rows' loss masks; SkyRL's per-sequence means (its KL loss, its value loss) still count
        # those rows, the backend's count the sequences with a trained token.
        raise ArcticSetupError("generator.apply_overlong_filtering with a critic or use_kl_loss: SkyRL's per-sequence "
                               "means then count rows without a trained token, which the backend does not")
    if uses_critic(cfg) and getattr(cfg.trainer.critic.model, "lora", None) is not None \
            and getattr(cfg.trainer.critic.model.lora, "rank", 0):
        raise ArcticSetupError("trainer.critic.model.lora.rank > 0: the Arctic RL job trains the critic's full weights")
    if algorithm.use_tis or _off_policy_correction_on(algorithm.off_policy_correction):
        key = "use_tis" if algorithm.use_tis else "off_policy_correction"
        raise ArcticSetupError(f"{ALGORITHM}.{key}: SkyRL's off-policy correction is not mapped onto the backend's "
                               "loss; leave it off")
    if algorithm.enable_sample_support_replay:
        raise ArcticSetupError(f"{ALGORITHM}.enable_sample_support_replay: the backend scores the model's full "
                               "distribution; leave it off")
    if algorithm.use_entropy_loss and entropy_aggregation(cfg) is None:
        raise ArcticSetupError(f"{ALGORITHM}.use_entropy_loss with trainer.micro_train_batch_size_per_gpu="
                               f"{cfg.trainer.micro_train_batch_size_per_gpu}: SkyRL's entropy bonus then depends on "
                               "its micro-batching; set it to 1 (or to the whole mini-batch)")
    lora = getattr(cfg.trainer.policy.model, "lora", None)
    if lora is not None and getattr(lora, "rank", 0):
        raise ArcticSetupError("trainer.policy.model.lora.rank > 0: the Arctic RL job trains full weights")


def entropy_aggregation(cfg) -> str | None:
    """How SkyRL aggregates its entropy bonus over a mini-batch, as one of our modes; None if it depends on
    SkyRL's micro-batching (micro-batches neither of one sample nor of the whole mini-batch)."""
    micro = cfg.trainer.micro_train_batch_size_per_gpu
    mini = cfg.trainer.policy_mini_batch_size * cfg.generator.n_samples_per_prompt
    if micro == 1:
        return "seq-mean-token-mean"
    if micro >= mini and not cfg.generator.step_wise_trajectories:
        return "token-mean"
    return None


def loss_spec(cfg) -> LossSpec:
    """The backend's loss for SkyRL's policy loss: PPO clip (clip-higher, dual clip; GSPO's sequence ratio), CISPO or
    SAPO's soft gate, summed over SkyRL's scaled advantages, with SkyRL's entropy and KL terms, at SkyRL's training
    temperature."""
    algorithm = cfg.trainer.algorithm
    config: dict = {"loss_agg_mode": "token-sum"}
    if algorithm.policy_loss_type == "sapo":
        config.update(sapo_tau_pos=algorithm.sapo.tau_pos, sapo_tau_neg=algorithm.sapo.tau_neg)
    elif algorithm.policy_loss_type == "cispo":
        config.update(use_cispo_loss=True, is_weight_clip_min=max(0.0, 1 - algorithm.cispo.cispo_eps_clip_low),
                      is_weight_clip_max=1 + algorithm.cispo.cispo_eps_clip_high)
    else:
        config.update(eps_clip=algorithm.eps_clip_low, eps_clip_higher=algorithm.eps_clip_high)
        if algorithm.policy_loss_type == "dual_clip":
            config["c_clip"] = algorithm.clip_ratio_c
        if algorithm.policy_loss_type == "gspo":
            config["importance_ratio"] = "sequence"
    if algorithm.use_entropy_loss:
        config.update(entropy_coeff=algorithm.entropy_loss_coef, entropy_agg_mode=entropy_aggregation(cfg))
    if algorithm.use_kl_loss and algorithm.kl_loss_coef > 0:
        # SkyRL's KL loss is each sequence's token mean, averaged over the mini-batch, whatever its micro-batching.
        config.update(kl_loss_coef=algorithm.kl_loss_coef, kl_loss_type=KL_ESTIMATORS[algorithm.kl_estimator_type],
                      kl_agg_mode="seq-mean-token-mean")
    temperature = algorithm.temperature if algorithm.temperature is not None else 1.0
    post = [{"name": "apply_temperature", "config": {"temperature": temperature}}] if temperature != 1.0 else []
    return LossSpec(name="grpo", config=config, post=post)


def critic_loss_spec(cfg) -> LossSpec:
    """The backend's `value` loss for SkyRL's `ppo_critic_loss`: the clipped (`value_clip`; none when null) squared
    error, halved, a token mean per sequence averaged over the mini-batch's sequences."""
    clip = cfg.trainer.algorithm.value_clip
    return LossSpec(name="value", config={"cliprange_value": clip, "loss_agg_mode": "seq-mean-token-mean"})


def behaviour_key(cfg) -> str:
    """The batch field SkyRL's loss takes its ratio against: the old policy's log-probs, or the rollout's for
    CISPO anchored on the rollout."""
    algorithm = cfg.trainer.algorithm
    if algorithm.policy_loss_type == "cispo" and algorithm.cispo.cispo_anchor == "rollout":
        return "rollout_logprobs"
    return "action_log_probs"
