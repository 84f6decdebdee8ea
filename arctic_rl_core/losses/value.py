"""The critic's clipped value loss (PPO's), on the critic's values V for the response tokens:

  V_clip = old + clamp(V - old, -cliprange_value, cliprange_value)
  loss   = 0.5 * aggregate(max((V - R)^2, (V_clip - R)^2), loss_agg_mode)

with R the returns and `old` the values the batch was scored with, as verl's `compute_value_loss` (SkyRL's
`ppo_critic_loss` with seq-mean-token-mean); without `cliprange_value`, the plain squared error.
Metrics: the fraction of tokens where the clipped term is larger (`vf_clipfrac`) and the mean value.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.losses.inputs import AggregationMode, LossInputs
from arctic_rl_core.losses.registry import register_loss_fn


class ValueLossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cliprange_value: float | None = Field(0.5, ge=0)
    """None: no clip (SkyRL's `value_clip: null`)."""
    loss_agg_mode: AggregationMode = "token-mean"


@register_loss_fn("value", config=ValueLossConfig, requires=("returns", "old_values"), model="critic")
def value_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: ValueLossConfig):
    values, returns, old = outputs["values"], inputs.returns, inputs.old_values
    clip = config.cliprange_value
    clipped = values if clip is None else old + (values - old).clamp(-clip, clip)
    plain_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * inputs.aggregate(torch.maximum(plain_error, clipped_error), config.loss_agg_mode)
    return loss, {"vf_clipfrac": inputs.token_mean((clipped_error > plain_error).float()),
                  "vpred_mean": inputs.token_mean(values)}
