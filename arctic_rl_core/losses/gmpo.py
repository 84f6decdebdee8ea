"""GMPO (geometric-mean policy optimisation): a sequence-level objective on the geometric mean of clipped ratios.

Per sequence i over its trained tokens t (logp: current, old: behaviour, A: advantage, s = sign(A)):

  d      = logp - old,   d_clip = clamp(d, -eps_clip, eps_clip_higher)
  m      = s * min(s * d, s * d_clip)                   (the pessimistic log-ratio, token by token)
  ratio  = exp(mean_t m),   adv = mean_t A
  loss   = mean over sequences of -adv * ratio

As verl's `geo_mean` (https://arxiv.org/abs/2507.20673). A sequence lies whole in one micro-batch; the
mean over sequences uses the batch's count, so micro-batch losses add up to the batch's.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import register_loss_fn


class GMPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    eps_clip: float = Field(0.4, ge=0)
    eps_clip_higher: float | None = Field(None, ge=0)
    """Upper bound of the log-ratio's clip. Defaults to eps_clip."""


def _per_sequence_mean(values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    mask = inputs.loss_mask
    sums = torch.zeros(inputs.seq_tokens.shape[0], dtype=values.dtype, device=values.device)
    return sums.index_add(0, inputs.seq_index, values * mask) / inputs.seq_tokens.to(values.dtype).clamp(min=1)


@register_loss_fn("gmpo", config=GMPOConfig, requires=("advantages", "behaviour_logprobs"))
def gmpo_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: GMPOConfig):
    logp, adv = outputs["logprobs"], inputs.advantages
    high = config.eps_clip if config.eps_clip_higher is None else config.eps_clip_higher
    d = logp - inputs.behaviour_logprobs
    d_clip = d.clamp(-config.eps_clip, high)
    sign = torch.sign(adv)
    m = sign * torch.minimum(sign * d, sign * d_clip)
    present = torch.zeros_like(inputs.seq_tokens, dtype=torch.bool)
    present[inputs.seq_index] = True  # the sequences of this micro-batch
    ratio = torch.exp(_per_sequence_mean(m, inputs))[present]
    seq_adv = _per_sequence_mean(adv, inputs)[present]
    loss = (-seq_adv * ratio).sum() / max(inputs.num_sequences, 1)
    clipped = (d != d_clip).to(logp.dtype) * inputs.loss_mask
    return loss, {"ratio_mean": inputs.token_mean(torch.exp(d).detach() * inputs.loss_mask),
                  "clip_frac": inputs.token_mean(clipped)}
