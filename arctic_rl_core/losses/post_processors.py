"""Built-in post-processors: transformations of the response-position logits before the loss."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import register_post_processor


class TemperatureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(gt=0)


@register_post_processor("apply_temperature", config=TemperatureConfig)
def apply_temperature(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: TemperatureConfig):
    """Divide logits by the sampling temperature so log-probs match the sampler's distribution."""
    return {"logits": outputs["logits"] / config.temperature}


@register_post_processor("compute_logprobs")
def compute_logprobs(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: None):
    logits = outputs["logits"].float()
    targets = outputs["targets"]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return {"logprobs": logprobs}


@register_post_processor("compute_entropy")
def compute_entropy(outputs: dict[str, torch.Tensor], inputs: LossInputs, config: None):
    logits = outputs["logits"].float()
    logp = torch.log_softmax(logits, dim=-1)
    return {"entropy": -(logp.exp() * logp).sum(-1)}
