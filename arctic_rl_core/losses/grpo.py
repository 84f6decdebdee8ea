"""GRPO / PPO-family policy loss with the knobs RL researchers use.

Per response token (logp: current policy, old: behaviour policy, A: advantage):

  prox   = old                                      (use_decoupled_loss=False)
         = proximal_logprobs or logp.detach()       (prox_logp_method=recompute)
         = old + a * (logp.detach() - old)          (prox_logp_method=loglinear,
             a = (d - 1) / d, d = current_version - behaviour_version, a = 0 for d <= 1)
  r      = exp(logp - prox)
         = exp(sg(mean_seq(logp - prox)) + logp - sg(logp)), clamped at e^10   (importance_ratio=sequence: GSPO)
  pg     = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))      (PPO, clip-higher)
  pg     = min(pg, -A c_clip)   where A < 0                               (dual clip)
  pg     = -sg(clip(r, is_weight_clip_min, is_weight_clip_max)) A logp   (CISPO instead; bounds 1, 1: GPG's -A logp)
  pg     = -sigmoid(tau (r - 1)) (4 / tau) A,  tau = sapo_tau_pos (A > 0) or sapo_tau_neg   (SAPO instead)
  pg     = -(A logp - dro_beta / 2 (logp - prox)^2)                        (DRO instead)
  pg     = -sg(min(r, c_clip)) A logp, 0 where the token's probability moved past the clip in A's direction:
           p - p_prox > eps_clip_higher (A > 0) or < -eps_clip (A < 0)  (dppo_divergence=tv);  binary KL
           of the token's Bernoulli above the bound, p moving with A  (binary_kl)   (DPPO instead; r's log
           clamped to +-20, c_clip defaults to 20)
  pg    *= sg(exp(prox - old)), tokens with weight > behav_imp_weight_cap masked   (decoupled)
  pg    *= is_weights   (when the sequences carry them: the caller's importance weights)
  M2PO:  mask the tokens with the largest (prox - old)^2 until the rest's mean < m2_threshold
  KL     k1: logp - ref;   k3 / low_var_kl: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
  loss   = aggregate(pg, loss_agg_mode) + kl_loss_coef * aggregate(KL, kl_agg_mode or loss_agg_mode)
           - entropy_coeff * aggregate(entropy, entropy_agg_mode or loss_agg_mode)

Without behaviour log-probs the data is taken as on-policy: old = logp.detach().
docs/losses.md gives the same formulas with every config key.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from arctic_rl_core.losses.inputs import LossInputs, ScaledAggregationMode
from arctic_rl_core.losses.registry import register_loss_fn
from arctic_rl_core.types import MAX_VERSION


class GRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    eps_clip: float = Field(0.2, ge=0)
    importance_ratio: Literal["token", "sequence"] = "token"
    """`sequence`: GSPO's ratio, each token's the geometric mean of its sequence's (gradient per token)."""
    eps_clip_higher: float | None = Field(None, ge=0)
    """Upper clip bound (clip-higher, DAPO). Defaults to eps_clip."""
    c_clip: float | None = Field(None, gt=1)
    """Dual-clip constant for negative advantages."""
    loss_agg_mode: ScaledAggregationMode = "token-mean"
    kl_agg_mode: ScaledAggregationMode | None = None
    """How the KL term is aggregated, when not as the rest of the loss (SkyRL: per sequence)."""
    entropy_agg_mode: ScaledAggregationMode | None = None
    """How the entropy term is aggregated, when not as the rest of the loss (SkyRL: per sequence)."""
    loss_scale_factor: float | None = Field(None, gt=0)
    """What the terms aggregated with `seq-mean-token-sum-norm` are divided by (verl's loss_scale_factor)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["k1", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coeff: float = 0.0
    use_cispo_loss: bool = False
    sapo_tau_pos: float | None = Field(None, gt=0)
    """SAPO instead of PPO's clip: a soft gate on the ratio, this sharp where A > 0 (and `sapo_tau_neg` elsewhere)."""
    sapo_tau_neg: float | None = Field(None, gt=0)
    dro_beta: float | None = Field(None, gt=0)
    """DRO instead of PPO's clip: -A logp plus this times half the squared log-ratio to the proximal policy."""
    dppo_divergence: Literal["tv", "binary_kl"] | None = None
    """DPPO instead of PPO's clip: a token's plain gradient, truncated by c_clip, dropped once its probability has
    moved past the clip bounds in its advantage's direction, measured by this divergence."""
    is_weight_clip_min: float = Field(0.0, ge=0)
    is_weight_clip_max: float = Field(5.0, gt=0)
    m2_threshold: float | None = Field(None, gt=0)
    use_decoupled_loss: bool = False
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    behav_imp_weight_cap: float | None = Field(None, gt=0)
    current_version: int | None = Field(None, ge=0, le=MAX_VERSION)
    """Version of the policy being trained, for loglinear; defaults to the engine's weight version."""

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        modes = (self.loss_agg_mode, self.kl_agg_mode, self.entropy_agg_mode)
        if "seq-mean-token-sum-norm" in modes and self.loss_scale_factor is None:
            raise ValueError("seq-mean-token-sum-norm divides by loss_scale_factor: set it")
        if self.is_weight_clip_min > self.is_weight_clip_max:
            raise ValueError("is_weight_clip_min must not be above is_weight_clip_max")
        if (self.sapo_tau_pos is None) != (self.sapo_tau_neg is None):
            raise ValueError("SAPO needs both sapo_tau_pos and sapo_tau_neg")
        replacements = [name for name, on in (("use_cispo_loss", self.use_cispo_loss),
                                              ("sapo_tau_pos", self.sapo_tau_pos is not None),
                                              ("dro_beta", self.dro_beta is not None),
                                              ("dppo_divergence", self.dppo_divergence is not None)) if on]
        if len(replacements) > 1:
            raise ValueError(f"{' and '.join(replacements)} each replace PPO's clip: set one")
        if replacements and replacements != ["dppo_divergence"] and self.c_clip is not None:
            raise ValueError(f"c_clip is PPO's dual clip (DPPO's truncation): not with {replacements[0]}")
        if replacements and self.importance_ratio == "sequence":
            raise ValueError(f"importance_ratio 'sequence' (GSPO) is PPO's clip on a sequence ratio: not with "
                             f"{replacements[0]}")
        if self.importance_ratio == "sequence" and self.use_decoupled_loss:
            raise ValueError("importance_ratio 'sequence' (GSPO) is PPO's clip on a sequence ratio: not with "
                             "use_decoupled_loss")
        return self

    def required_fields(self) -> tuple[str, ...]:
        needed = []
        if self.use_decoupled_loss or self.m2_threshold is not None:
            needed.append("behaviour_logprobs")
        if self.use_decoupled_loss and self.prox_logp_method == "loglinear":
            needed.append("behaviour_version")
        if self.kl_loss_coef > 0:
            needed.append("ref_logprobs")
        return tuple(needed)

    def needs_entropy(self) -> bool:
        return self.entropy_coeff != 0


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return logp - ref
    log_ratio = ref - logp
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


def loglinear_proximal(logp: torch.Tensor, old: torch.Tensor, behaviour_version: torch.Tensor, current_version: int):
    """Log-linear interpolation to the policy one version behind `current_version` (A-3PO)."""
    staleness = (current_version - behaviour_version).to(logp.dtype)
    alpha = torch.where(staleness > 1, (staleness - 1) / staleness.clamp(min=1), torch.zeros_like(staleness))
    return old + alpha * (logp.detach() - old)


def sequence_log_ratio(logp: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """GSPO-token's log-ratio: sg(mean over the sequence's trained tokens of log(pi/pi_prox)) + logp - sg(logp),
    clamped above at 10 as GSPO's implementations clamp it. A sequence lies whole in one micro-batch."""
    per_token = ((logp - prox) * mask).detach()
    sums = torch.zeros(inputs.seq_tokens.shape[0], dtype=per_token.dtype, device=per_token.device)
    sums = sums.index_add(0, inputs.seq_index, per_token)
    means = sums / inputs.seq_tokens.to(per_token.dtype).clamp(min=1)
    return (logp - logp.detach() + means[inputs.seq_index]).clamp(max=10.0)


def m2po_keep_mask(second_moment: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 for tokens kept after masking the largest values until the rest's mean is below `threshold`."""
    keep = valid.clone()
    values = second_moment[valid > 0]
    if values.numel() == 0 or values.mean() < threshold:
        return keep
    ordered, order = torch.sort(values, descending=True)
    n = ordered.numel()
    removed = torch.arange(n + 1, dtype=ordered.dtype, device=ordered.device)
    rest_sum = ordered.sum() - torch.cat([ordered.new_zeros(1), ordered.cumsum(0)])
    rest_mean = rest_sum / (n - removed).clamp(min=1)
    below = (rest_mean < threshold).nonzero()
    k = int(below[0]) if below.numel() else n
    dropped = torch.zeros(n, dtype=keep.dtype, device=keep.device)
    dropped[order[:k]] = 1
    kept_valid = keep[valid > 0] * (1 - dropped)
    keep[valid > 0] = kept_valid
    return keep


def dppo_keep(logp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, low: float, high: float, divergence: str):
    """1 for tokens DPPO trains: those whose probability has not moved past the bound in the advantage's direction."""
    p, p_prox = torch.exp(logp.detach()), torch.exp(prox)
    if divergence == "tv":
        up, down = (p - p_prox) <= high, (p - p_prox) >= -low
    else:
        binary_kl = p_prox * (prox - logp.detach()) + (1 - p_prox) * torch.log((1.0 - p_prox + 1e-8) / (1.0 - p + 1e-8))
        up, down = (binary_kl <= high) | (p <= p_prox), (binary_kl <= low) | (p >= p_prox)
    return torch.where(adv > 0, up, down).to(logp.dtype)


@register_loss_fn("grpo", config=GRPOConfig, requires=("advantages",), reads=("is_weights",))
def grpo_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: GRPOConfig):
    logp = outputs["logprobs"]
    adv = inputs.advantages
    mask = inputs.loss_mask
    old = inputs.behaviour_logprobs if inputs.behaviour_logprobs is not None else logp.detach()

    if not config.use_decoupled_loss:
        prox = old
    elif config.prox_logp_method == "recompute":
        prox = inputs.proximal_logprobs if inputs.proximal_logprobs is not None else logp.detach()
    else:
        current = config.current_version if config.current_version is not None else inputs.weight_version
        prox = loglinear_proximal(logp, old, inputs.behaviour_version, current)

    if config.importance_ratio == "sequence":
        ratio = torch.exp(sequence_log_ratio(logp, prox, mask, inputs))
    else:
        ratio = torch.exp(logp - prox)
    eps_high = config.eps_clip if config.eps_clip_higher is None else config.eps_clip_higher
    zero = torch.zeros_like(logp)
    if config.use_cispo_loss:
        is_weight = ratio.detach().clamp(config.is_weight_clip_min, config.is_weight_clip_max)
        pg = -is_weight * adv * logp
        r = ratio.detach()
        clipped = ((r < config.is_weight_clip_min) | (r > config.is_weight_clip_max)).to(logp.dtype)
        dual_clipped = zero
    elif config.sapo_tau_pos is not None:
        # The gate on a ratio whose log is clamped to +-20, as SAPO's implementations clamp it.
        r = torch.exp((logp - prox).clamp(-20.0, 20.0))
        tau = torch.where(adv > 0, torch.full_like(adv, config.sapo_tau_pos), torch.full_like(adv, config.sapo_tau_neg))
        pg = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
        clipped = dual_clipped = zero
    elif config.dro_beta is not None:
        pg = -(adv * logp - 0.5 * config.dro_beta * (logp - prox) ** 2)
        clipped = dual_clipped = zero
    elif config.dppo_divergence is not None:
        r = torch.exp((logp - prox).clamp(-20.0, 20.0)).detach()
        truncation = 20.0 if config.c_clip is None else config.c_clip
        trained = dppo_keep(logp, prox, adv, config.eps_clip, eps_high, config.dppo_divergence)
        pg = -r.clamp(max=truncation) * adv * logp * trained
        clipped = 1 - trained
        dual_clipped = (r > truncation).to(logp.dtype) * trained
    else:
        unclipped = -adv * ratio
        clipped_loss = -adv * ratio.clamp(1 - config.eps_clip, 1 + eps_high)
        pg = torch.maximum(unclipped, clipped_loss)
        clipped = (clipped_loss > unclipped).to(logp.dtype)
        dual_clipped = zero
        if config.c_clip is not None:
            floor = -adv * config.c_clip
            dual_clipped = ((adv < 0) & (pg > floor)).to(logp.dtype)
            pg = torch.where(adv < 0, torch.minimum(pg, floor), pg)

    if inputs.is_weights is not None:
        pg = pg * inputs.is_weights
    # `keep` drops tokens from the loss on top of the caller's mask; denominators stay batch-wide,
    # so a dropped token counts as "says nothing", as in AReaL and M2PO.
    active = (mask > 0).to(logp.dtype)
    dropped = zero
    behav_capped = zero
    if config.use_decoupled_loss:
        behav_weight = torch.exp(prox - old).detach()
        if config.behav_imp_weight_cap is not None:
            behav_capped = (behav_weight > config.behav_imp_weight_cap).to(logp.dtype) * active
            dropped = behav_capped
        pg = pg * behav_weight
    m2_masked = zero
    if config.m2_threshold is not None:
        target = prox if config.use_decoupled_loss else logp.detach()
        candidates = active * (1 - dropped)
        m2_masked = candidates - m2po_keep_mask((target.detach() - old) ** 2, candidates, config.m2_threshold)
        dropped = dropped + m2_masked
    keep = 1 - dropped

    metrics = {}
    weights = inputs.token_weights(config.loss_agg_mode, config.loss_scale_factor)
    loss = (pg * keep * weights).sum()
    if config.kl_loss_coef > 0:
        kl = kl_penalty(logp, inputs.ref_logprobs, config.kl_loss_type)
        kl_weights = weights if config.kl_agg_mode is None else inputs.token_weights(config.kl_agg_mode, config.loss_scale_factor)
        loss = loss + config.kl_loss_coef * (kl * keep * kl_weights).sum()
        metrics["kl"] = inputs.token_mean(kl * keep)
    if config.entropy_coeff != 0:
        entropy = outputs["entropy"]
        entropy_weights = weights if config.entropy_agg_mode is None else inputs.token_weights(config.entropy_agg_mode, config.loss_scale_factor)
        loss = loss - config.entropy_coeff * (entropy * keep * entropy_weights).sum()
        metrics["entropy"] = inputs.token_mean(entropy * keep)
    metrics.update(
        pg_loss=(pg * keep * weights).sum().detach(),
        clip_frac=inputs.token_mean(clipped * mask),
        dual_clip_frac=inputs.token_mean(dual_clipped * mask),
        ratio_mean=inputs.token_mean(ratio * mask),
        # How far the trained policy has moved from the proximal one (verl's ppo_kl).
        ppo_kl=inputs.token_mean((prox - logp).detach() * mask),
        behav_capped_frac=inputs.token_mean(behav_capped),
        m2po_masked_frac=inputs.token_mean(m2_masked),
    )
    return loss, metrics
