"""A LoRA adapter of a smaller rank, or on fewer modules, trained exactly inside the engine's larger one.

Tinker's models each ask for a rank and for the module families they train (`train_attn`, `train_mlp`,
`train_unembed`), while they share one engine whose adapter has the job's rank R on the job's modules. A rank-r
adapter is the first r rows of each A and the first r columns of each B: a forward hook on each `lora_A` zeroes
the other rows of its output (all of them on a module the model does not train), and each layer's scaling is
alpha / r, as PEFT sets it for a rank-r adapter. The zeroed rows pass no gradient, so the other columns of B keep
the zeros every untrained adapter starts with: the layer computes B[:, :r] A[:r], merged or not, and the adapter
written for the sampler is rank r. This holds from an untrained adapter on (B = 0): shaping a trained one is
refused by the callers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.lora_files import CONFIG_FILE, WEIGHTS_FILE

ADAPTER = "default"
FAMILIES = ("attn", "mlp", "unembed")
_MLP_PARTS = ("mlp", "feed_forward", "ffn", "experts", "moe")


@dataclass(frozen=True)
class AdapterShape:
    """The part of the engine's adapter a model trains: `rank` (at most the job's) on the families it keeps."""

    rank: int
    attn: bool = True
    mlp: bool = True
    unembed: bool = True


def family(name: str, is_head: bool) -> str | None:
    """"unembed", "attn" or "mlp" for an adapted module, by what its path says it is; None if it says neither."""
    if is_head:
        return "unembed"
    parts = name.lower().split(".")
    if any("attn" in part or "attention" in part for part in parts):
        return "attn"
    if any(any(word in part for word in _MLP_PARTS) for part in parts):
        return "mlp"
    return None


@dataclass(frozen=True)
class AdapterLayout:
    """The engine's adapter: its rank and each adapted module's family."""

    rank: int
    families: dict[str, str | None]

    def check(self, shape: AdapterShape | None, field: str = "lora_config") -> None:
        if shape is None:
            return
        if not 1 <= shape.rank <= self.rank:
            raise InvalidRequest(f"{field}.rank", f"must be 1 to {self.rank}, the rank of this job's adapters "
                                 f"(engine.lora.r), not {shape.rank}")
        unknown = [name for name, fam in self.families.items() if fam is None]
        for kept in FAMILIES:
            if not getattr(shape, kept) and unknown:
                raise InvalidRequest(f"{field}.train_{kept}", f"the job adapts {unknown[0]!r}, which this server "
                                     "cannot tell as attention, MLP or output head: every family must be trained")
        if not self.trained(shape):
            raise InvalidRequest(field, "trains none of the modules this job adapts "
                                 f"({sorted(set(self.families.values()))})")

    def normal(self, shape: AdapterShape | None) -> AdapterShape | None:
        """None where `shape` is the whole adapter."""
        full = shape is None or shape.rank == self.rank and len(self.trained(shape)) == len(self.families)
        return None if full else shape

    def trained(self, shape: AdapterShape | None) -> list[str]:
        return [name for name, fam in self.families.items() if shape is None or fam is None or getattr(shape, fam)]


class AdapterShaper:
    """Shapes a PEFT model's adapter (one adapter, vanilla LoRA) as an `AdapterShape`; `None` is the whole adapter."""

    def __init__(self, peft_model: torch.nn.Module, head: torch.nn.Module):
        from peft.tuners.lora import LoraLayer

        self.layers = {name: module for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
        first = next(iter(self.layers.values()))
        self.layout = AdapterLayout(first.r[ADAPTER], {name: family(name, layer is head)
                                                       for name, layer in self.layers.items()})
        self.alpha = first.lora_alpha[ADAPTER]
        self.scaling = {name: layer.scaling[ADAPTER] for name, layer in self.layers.items()}
        self.shape: AdapterShape | None = None
        self._hooks: list = []

    def apply(self, shape: AdapterShape | None) -> None:
        """The adapter computes `shape` from now on: masks on the lora_A outputs, alpha / rank as scaling."""
        self.layout.check(shape)
        shape = self.layout.normal(shape)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.shape = shape
        if shape is None:
            for name, layer in self.layers.items():
                layer.scaling[ADAPTER] = self.scaling[name]
            return
        kept = set(self.layout.trained(shape))
        for name, layer in self.layers.items():
            # What PEFT sets for a rank-r adapter: alpha / r (rsLoRA: alpha / sqrt(r)).
            root = math.sqrt(shape.rank) if layer.use_rslora[ADAPTER] else shape.rank
            layer.scaling[ADAPTER] = self.alpha / root
            lora_a = layer.lora_A[ADAPTER]
            mask = torch.zeros(self.layout.rank, dtype=lora_a.weight.dtype, device=lora_a.weight.device)
            if name in kept:
                mask[:shape.rank] = 1
            self._hooks.append(lora_a.register_forward_hook(lambda _m, _x, out, mask=mask: out * mask))

    def write(self, path: str) -> None:
        """Rewrite the adapter PEFT saved at `path` (the whole rank-R adapter) as the shaped one: rank r, only the
        trained modules."""
        if self.shape is None:
            return
        from safetensors.torch import load_file, save_file

        rank, kept = self.shape.rank, set(self.layout.trained(self.shape))
        tensors = {}
        for key, tensor in load_file(os.path.join(path, WEIGHTS_FILE)).items():
            module, _, part = key.rpartition(".lora_")
            if module not in kept:
                continue
            tensors[key] = (tensor[:rank] if part.startswith("A.") else tensor[:, :rank]).contiguous()
        save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
        prefix = "base_model.model."
        config.update(r=rank, target_modules=sorted(name.removeprefix(prefix) for name in kept))
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
