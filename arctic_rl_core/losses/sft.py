"""Supervised fine-tuning: token cross-entropy on the response."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import register_loss_fn


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "prompt-mean"] = "token-mean"


@register_loss_fn("sft", config=SFTConfig)
def sft_loss(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: SFTConfig):
    nll = -outputs["logprobs"]
    loss = inputs.aggregate(nll, config.loss_agg_mode)
    return loss, {"nll": inputs.token_mean(nll)}
