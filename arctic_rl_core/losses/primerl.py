"""prime-rl's RL losses (its trainer's `trainer.loss`, prime-rl 0.8.0): `default` and `ipo`.

Per response token (logp: current policy at the sampling temperature, inf: the inference server's log-probs,
A: advantage, m: loss mask), against the inference log-probs, with no recomputed old policy:

  l      = logp - inf,   r = exp(l),   d = exp(logp) - exp(inf)
  masked = d > mask_high where A > 0, d < -mask_low elsewhere    (`primerl_default`: DPPO-Binary-TV)
         = |d| > ipo_threshold                                  (`primerl_ipo`)
  token  = -(1 - masked) * adv_tau * A * r + kl_tau * l^2       (the KL term on every trained token)
  loss   = sum over trained tokens / number of trained tokens in the whole step

The step-wide token count is prime-rl's own normalisation (its `rl_scale`), `token-mean` here. A masked token
keeps its KL term and its place in the denominator, as in prime-rl.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import register_loss_fn


class PrimeRLDefaultConfig(BaseModel):
    """prime-rl's `DefaultLossConfig`, the same fields and defaults."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dppo_mask_low: float = Field(0.2, ge=0)
    dppo_mask_high: float = Field(0.2, ge=0)
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float = Field(1e-3, ge=0)


class PrimeRLIPOConfig(BaseModel):
    """prime-rl's `IPOLossConfig`, the same fields and defaults."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ipo_threshold: float = Field(0.1, ge=0)
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float = Field(1e-3, ge=0)


def _masked_policy_gradient(logp: torch.Tensor, inputs: LossInputs, masked: torch.Tensor, adv_tau: float,
                            kl_tau: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trained = inputs.loss_mask > 0
    log_ratio = logp - inputs.behaviour_logprobs
    ratio = torch.exp(log_ratio)
    keep = (trained & ~masked).to(logp.dtype)
    token_loss = -keep * (adv_tau * inputs.advantages) * ratio + kl_tau * trained.to(logp.dtype) * log_ratio ** 2
    mismatch_kl = (ratio - log_ratio - 1).detach()
    metrics = {"is_masked": inputs.token_mean(masked & trained),
               "mismatch_kl": inputs.token_mean(mismatch_kl * trained),
               "ratio_mean": inputs.token_mean(ratio.detach() * trained)}
    return inputs.aggregate(token_loss, "token-mean"), metrics


def _probability_moved(logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return torch.exp(logp.detach()) - torch.exp(inputs.behaviour_logprobs)


@register_loss_fn("primerl_default", config=PrimeRLDefaultConfig, requires=("advantages", "behaviour_logprobs"))
def primerl_default_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: PrimeRLDefaultConfig):
    logp = outputs["logprobs"]
    moved = _probability_moved(logp, inputs)
    up = inputs.advantages > 0
    masked_high, masked_low = moved > config.dppo_mask_high, moved < -config.dppo_mask_low
    loss, metrics = _masked_policy_gradient(logp, inputs, torch.where(up, masked_high, masked_low),
                                            config.adv_tau, config.kl_tau)
    trained = inputs.loss_mask > 0
    metrics["is_masked_high"] = inputs.token_mean(up & masked_high & trained)
    metrics["is_masked_low"] = inputs.token_mean((inputs.advantages < 0) & masked_low & trained)
    return loss, metrics


@register_loss_fn("primerl_ipo", config=PrimeRLIPOConfig, requires=("advantages", "behaviour_logprobs"))
def primerl_ipo_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: PrimeRLIPOConfig):
    logp = outputs["logprobs"]
    masked = _probability_moved(logp, inputs).abs() > config.ipo_threshold
    return _masked_policy_gradient(logp, inputs, masked, config.adv_tau, config.kl_tau)
