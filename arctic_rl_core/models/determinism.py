"""The trainer's forward is the model's inference forward: RL divides by log-probs that must be the
sampler's. Dropout is off, and so is every other training-only behaviour (router jitter, experts
sampled while training as PhiMoE's sparsemixer does), which no config key names reliably."""

from __future__ import annotations

import torch

_DROPOUT = ("dropout", "pdrop")


def without_dropout(config):
    """Set every dropout probability of `config` (and its text config) to 0, before the model is built:
    modules copy theirs at construction, so zeroing the config afterwards is too late. This covers layers
    that apply dropout functionally with their own training flag, which gradient checkpointing keeps on."""
    for sub in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in vars(sub).items():
            if isinstance(value, float) and any(word in key for word in _DROPOUT):
                setattr(sub, key, 0.0)
    return config


def inference_behaviour(model: torch.nn.Module) -> None:
    """Every module in inference mode, except the training flag of the modules that decide whether to
    checkpoint (transformers checkpoints only `if self.gradient_checkpointing and self.training`).
    Gradients flow in inference mode all the same; the engine never flips modes afterwards, so
    concurrent log_probs and fwd_bwd calls cannot flip each other's."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True or (
            isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
        ):
            module.training = True
