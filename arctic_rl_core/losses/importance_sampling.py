"""Importance-sampled policy gradient: -exp(logp - behaviour) * A per token, no clipping."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from arctic_rl_core.losses.inputs import AggregationMode, LossInputs
from arctic_rl_core.losses.registry import register_loss_fn


class ImportanceSamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loss_agg_mode: AggregationMode = "token-mean"


@register_loss_fn("importance_sampling", config=ImportanceSamplingConfig, requires=("advantages", "behaviour_logprobs"))
def importance_sampling_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: ImportanceSamplingConfig):
    ratio = torch.exp(outputs["logprobs"] - inputs.behaviour_logprobs)
    token_loss = -ratio * inputs.advantages
    loss = inputs.aggregate(token_loss, config.loss_agg_mode)
    return loss, {"ratio_mean": inputs.token_mean(ratio)}
