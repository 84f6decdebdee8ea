"""A PEFT LoRA adapter as saved by `save_pretrained` (adapter_config.json, adapter_model.safetensors), read as the
change it makes to each base weight: scale · B @ A. Only what the trainer's adapters use is read; anything else
the file asks for (DoRA, per-module ranks, extra trained modules) is refused by name."""

from __future__ import annotations

import math
import os

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def lora_deltas(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Base parameter name -> the adapter's change to it."""
    import peft
    from safetensors.torch import load_file

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)) or not os.path.isfile(weights):
        raise ValueError(f"{path} holds no PEFT adapter ({CONFIG_FILE} and {WEIGHTS_FILE})")
    config = peft.LoraConfig.from_pretrained(path)
    for name in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if getattr(config, name, None):
            raise ValueError(f"{path}: the adapter's {name} is not served")
    scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    tensors = load_file(weights)
    deltas = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix(_PEFT_PREFIX).split(".lora_A.")[0]
        deltas[f"{module}.weight"] = (scale * (b.double() @ a.double())).to(dtype)
    if not deltas or len(deltas) * 2 != len(tensors):
        raise ValueError(f"{path}: expected lora_A/lora_B pairs only, found {sorted(tensors)[:4]}")
    return deltas
