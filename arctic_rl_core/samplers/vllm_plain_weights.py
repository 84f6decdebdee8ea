"""vLLM model loaders for CPU that keep linear weights in their checkpoint layout, so a sync is a copy.

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

The packed variant (`PACKED_LOAD_FORMAT`, `cpu_weight_layout: packed`, the
default) keeps the same writable weights and multiplies with vLLM's own oneDNN
packs built from them, as vLLM's default loader does, at the step sizes where
they are faster (`PACKED_ROWS`), and with F.linear on the weights elsewhere.
Each layer's pack is rebuilt from its written weights after a sync (`repack`),
which costs oneDNN's reorder of every linear weight and holds them twice.

vLLM imports this module with the worker extension (`vllm_worker`), in the
process that loads the model; the sampler selects the loader by its
`load_format` name.
"""

from __future__ import annotations

import copy
import functools
import gc

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from arctic_rl_core.patches import InstancePatch
from arctic_rl_core.samplers.vllm_eager_ranks import use_eager_ranks

LOAD_FORMAT = "arctic_rl_plain_cpu_weights"
PACKED_LOAD_FORMAT = "arctic_rl_packed_cpu_weights"
MARKER = "arctic_rl_plain_weights"
"""Set on the loaded model: its weights can be overwritten in place by `load_weights`."""
PACKED_MARKER = "arctic_rl_packed_from_plain"
"""Set on a model loaded by the packed variant: after its weights are written, `repack` it."""
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


def _layers_with_gemm(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that multiply through vLLM's CPU GEMM dispatch (linear layers and the LM head)."""
    return [m for m in model.modules() if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None
            and m.weight.ndim == 2]


PACKED_ROWS = (4, 256)
"""Rows (tokens in the step) for which a layer multiplies with its oneDNN pack; F.linear on the kept weight outside.
Measured on a 2-core Xeon (fp32, N x K from 1152 x 384 to 5504 x 2048): the pack takes 0.34-0.70x F.linear's time
from 4 to 64 rows, 0.84-1.02x at 128-256, but 1.03-1.20x at 1-2 rows and 1.0-1.3x at 512-1,024 (prefills)."""


def _by_rows(packed, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if PACKED_ROWS[0] <= rows <= PACKED_ROWS[1]:
        return packed(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _pack(model: torch.nn.Module) -> int:
    layers = _layers_with_gemm(model)
    for module in layers:  # with remove_weight=False vLLM's dispatch keeps the weight and packs a copy of it
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        module.cpu_linear = functools.partial(_by_rows, module.cpu_linear)
    return len(layers)


def _pack_kept_weights(model: torch.nn.Module) -> int:
    setattr(model, MARKER, True)
    setattr(model, PACKED_MARKER, True)
    return _pack(model)


def repack(model: torch.nn.Module) -> int:
    """Rebuild every layer's oneDNN pack from its kept weight (after a sync wrote it); a plain model has none."""
    return _pack(model) if getattr(model, PACKED_MARKER, False) else 0


KEEP_LINEAR_WEIGHTS = InstancePatch(
    "linear layers keep their checkpoint-layout weights (_cpu_skip_gemm_dispatch)", _keep_linear_weights,
    "a weight sync writes in place instead of rebuilding and repacking every layer", __name__)
MULTIPLY_WITH_KEPT_WEIGHTS = InstancePatch(
    "LM head multiplies with F.linear on its kept weight (cpu_linear)", _multiply_with_kept_weights,
    "the head ignores _cpu_skip_gemm_dispatch; its synced weight must be the one it reads", __name__)


PACK_KEPT_WEIGHTS = InstancePatch(
    "linear layers and LM head multiply with oneDNN packs built from their kept weights (cpu_linear)",
    _pack_kept_weights, "vLLM's faster small-batch kernels, on weights a sync can still write in place", __name__)


def _plain(model_config) -> bool:
    architectures = set(model_config.architectures or ())
    return model_config.quantization is None and bool(architectures) and architectures <= PLAIN_ARCHITECTURES


@register_model_loader(LOAD_FORMAT)
class PlainCpuWeightsLoader(DefaultModelLoader):
    packed = False

    def __init__(self, load_config):
        files = copy.copy(load_config)
        files.load_format = "auto"  # the checkpoint files are found and read as the default loader does
        super().__init__(files)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        if _plain(model_config):
            KEEP_LINEAR_WEIGHTS.apply(model)
        super().load_weights(model, model_config)

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        use_eager_ranks()  # this engine's process samples on CPU
        # vLLM freezes the heap its engine starts with (EngineCore.__init__) and unfreezes it at the engine's shutdown.
        # Before that, its full collections (after loading, after the profiling run, before freezing) each traverse
        # every object this process's imports made. Frozen from here, they traverse only what the engine adds.
        gc.freeze()
        model = super().load_model(vllm_config, model_config, prefix)
        if not _plain(model_config):
            return model
        (PACK_KEPT_WEIGHTS if self.packed else MULTIPLY_WITH_KEPT_WEIGHTS).apply(model)
        return model


@register_model_loader(PACKED_LOAD_FORMAT)
class PackedCpuWeightsLoader(PlainCpuWeightsLoader):
    packed = True
