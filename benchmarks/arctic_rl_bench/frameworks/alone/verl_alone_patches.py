"""The runtime patches that let verl 0.9.1 run alone (its FSDP actor, its vLLM rollout) on a CPU, and nothing more.

verl imports this module in every process that imports verl (driver, TaskRunner, FSDP worker, vLLM server actor,
vLLM's engine-core and worker processes) through its own hook, `VERL_USE_EXTERNAL_MODULES=verl_alone_patches`,
with this folder on PYTHONPATH (verl_runner.py sets both, for Ray's workers too). Each patch says why it is needed
and why it does not change what the bench times. They record themselves in `APPLIED`, refuse to apply twice in one
process, and each process prints what it applied (the runner keeps the lines in verl's log).

Self-contained on purpose: the alone column imports nothing of Arctic RL (not even arctic_rl_core.patches).
"""

from __future__ import annotations

import inspect
import os
import sys
from contextlib import contextmanager

import alone_patching
from alone_patching import APPLIED, AlonePatch, AppliedTwice, apply, no_gpu, when_imported  # noqa: F401 (the API)


# -- P1: a CPU platform --------------------------------------------------------------------------------------

def _cpu_platform() -> None:
    import torch
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    class CPUDevice:
        """torch.cpu, plus the torch.cuda-style memory, RNG and sync calls verl makes on get_torch_device()."""

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def is_available(self):
            return True

        def empty_cache(self, *a, **k):
            pass

        ipc_collect = reset_peak_memory_stats = set_per_process_memory_fraction = synchronize = set_device = empty_cache

        def memory_allocated(self, *a, **k):
            return 0

        memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

        def mem_get_info(self, *a, **k):
            import psutil

            memory = psutil.virtual_memory()
            return memory.available, memory.total

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def get_rng_state(self, *a, **k):
            return torch.get_rng_state()

        def set_rng_state(self, state, *a, **k):
            torch.set_rng_state(state)

        def get_device_name(self, *a, **k):
            return "cpu"

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

    device = CPUDevice()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"  # verl passes it as a device (.to(), torch.device(), FSDP's device_id): 0 would be cuda:0

        def device_count(self):
            return 1

        def set_device(self, *a, **k):
            pass

        synchronize = set_allocator_settings = empty_cache = profiler_start = profiler_stop = set_device

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg):
            yield

        def ray_resource_name(self):
            return "GPU"  # verl's resource pool asks Ray for GPUs: Ray is started with one logical GPU

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False  # verl's weight sync then takes its own shared-memory path instead of CUDA IPC

        def cudart(self):
            return None

    # verl picks its platform while `import verl` runs, before this module: registering is too late, so replace it.
    set_platform(PlatformCPU())


# -- P2: the process group's backend ---------------------------------------------------------------------------

def _gloo_process_group() -> None:
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


# -- P3: vLLM-CPU keeps its linear layers' weights ----------------------------------------------------------------

def _vllm_in_use_on_cpu() -> bool:
    # Only in vLLM's own processes (they import vllm before verl's worker extension imports verl).
    return "vllm" in sys.modules and no_gpu()


def _vllm_cpu_keeps_linear_weights() -> None:
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    method = linear.UnquantizedLinearMethod
    original = method.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return original(self, layer)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    method.process_weights_after_loading = process_weights_after_loading


# -- P4: vLLM's pause_generation takes verl's keyword ---------------------------------------------------------------

ASYNC_LLM = "vllm.v1.engine.async_llm"


def _pause_generation_takes_verls_keyword(module) -> None:
    async_llm = module.AsyncLLM
    original = async_llm.pause_generation
    if "wait_for_inflight_requests" in inspect.signature(original).parameters:
        return

    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs):
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        return await original(self, **kwargs)

    async_llm.pause_generation = pause_generation


def _vllm_pause_keyword() -> None:
    when_imported(ASYNC_LLM, _pause_generation_takes_verls_keyword)


PATCHES = (
    AlonePatch(
        "P1 cpu-platform",
        why="verl 0.9.1 ships nvidia, huawei and amd platforms only and falls back to nvidia (torch.cuda calls, NCCL, "
            "device 'cuda'); its auto_set_device rewrites trainer.device=cpu to cuda unless the platform says cpu",
        timing="its sync and cache calls do nothing, as there is nothing to wait for on a CPU; reporting no IPC sends "
               "verl's weight sync down verl's own shared-memory path (one more copy per bucket than CUDA IPC)",
        needed=no_gpu, apply=_cpu_platform),
    AlonePatch(
        "P2 gloo-process-group",
        why="verl builds the backend 'cpu:gloo,cpu:gloo' on a CPU platform, which torch refuses; plain 'gloo' is the "
            "same backend for CPU tensors",
        timing="called once when a worker starts; one FSDP rank has no collectives on the hot path",
        needed=no_gpu, apply=_gloo_process_group),
    AlonePatch(
        "P3 vllm-cpu-keep-linear-weight",
        why="vLLM-CPU packs each linear weight for its GEMM kernels and drops the Parameter, so verl's weight sync "
            "(model.load_weights, then process_weights_after_loading) fails at the first sync and the engine dies",
        timing="generation runs the same packed kernels; each sync re-packs from the new weights, as vLLM's own "
               "reload would; one more copy of the linear weights in memory",
        needed=_vllm_in_use_on_cpu, apply=_vllm_cpu_keeps_linear_weights),
    AlonePatch(
        "P4 vllm-pause-keyword",
        why="verl 0.9.1's vLLM server pauses generation (its async trainers abort the batch in flight before a weight "
            "update) with pause_generation(wait_for_inflight_requests=False), which vLLM 0.32 renamed to "
            "mode='abort'; without it verl's colocate_async trainer fails at its first update",
        timing="the same vLLM call with the argument renamed; only verl's async trainers pause generation",
        needed=lambda: True, apply=_vllm_pause_keyword),
)


# -- Diagnostics: verl alone with its CPU fallbacks replaced by what its GPU path computes. Not the alone column. ----
#
# On a GPU verl takes log-probs from flash-attn's cross-entropy kernel and attends packed rows with flash-attn's varlen
# kernel (use_remove_padding). Neither exists on a CPU, and verl's fallbacks cost time there that a GPU user never
# pays. Each diagnostic replaces one fallback with a vectorised equivalent, exact for what verl reads, so the bench can
# measure how much of alone's time is the CPU's (`bench frameworks --alone-diagnostic`). A run with any of them is
# reported as such, never as verl alone.

DIAGNOSTICS_ENV = "VERL_ALONE_DIAGNOSTICS"
"""Comma-separated ids (D1, D2) of the diagnostics to apply in every process; unset: none (verl alone)."""


def logprobs_vectorised(logits, labels):
    """verl's logprobs_from_logits_v2 without its loop over rows: one log-sum-exp over the whole [..., V] tensor.
    The same arithmetic per row (fp32: label logit minus log-sum-exp; 16 bits: log-softmax, then the label's)."""
    import torch

    if logits.dtype in (torch.float32, torch.float64):
        return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _vectorised_logprobs() -> None:
    def replace(module) -> None:
        module.logprobs_from_logits_v2 = logprobs_vectorised  # logprobs_from_logits looks it up per call

    when_imported("verl.utils.torch_functional", replace)


def right_padded_only(padding_mask) -> bool:
    """Every row's real tokens first, then its padding (no padding token before a real one)."""
    import torch

    mask = padding_mask.bool()
    return bool(torch.all(mask[:, 1:] <= mask[:, :-1]))


def _causal_sdpa_for_right_padding(module) -> None:
    original = module._ignore_causal_mask_sdpa

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size):
            return True
        # A full forward (no cache) of right-padded rows: under `is_causal` a real token sees only the real tokens
        # before it, as under the dense mask. Only the padding's own rows differ, and verl drops them.
        return (padding_mask is not None and local_attention_size is None and q_offset == 0 and kv_offset == 0
                and q_length == kv_length == padding_mask.shape[-1] and right_padded_only(padding_mask))

    module._ignore_causal_mask_sdpa = _ignore_causal_mask_sdpa  # sdpa_mask looks it up per call


def _causal_sdpa() -> None:
    when_imported("transformers.masking_utils", _causal_sdpa_for_right_padding)


DIAGNOSTICS = (
    AlonePatch(
        "D1 vectorised-logprobs",
        why="without flash-attn (a GPU's log-prob kernel) verl computes each token's log-prob in a Python loop over "
            "the unpadded tokens (logprobs_from_logits_v2: one logsumexp call a token, 36K a step here), forward and "
            "backward",
        timing="changes the timing on purpose: one call over all tokens, the same arithmetic per token",
        needed=lambda: True, apply=_vectorised_logprobs),
    AlonePatch(
        "D2 causal-sdpa",
        why="without flash-attn's varlen kernel (use_remove_padding) verl right-pads its rows and hands transformers "
            "their padding mask, which becomes a dense [B, 1, L, L] SDPA mask: ATen's CPU flash kernel then computes "
            "every block, the causal half it could skip included",
        timing="changes the timing on purpose: SDPA with is_causal for right-padded rows, exact for every real token",
        needed=lambda: True, apply=_causal_sdpa),
)


def listing() -> list[dict[str, str]]:
    return alone_patching.listing(PATCHES)


def diagnostics_named(ids: str) -> list[AlonePatch]:
    """The diagnostics a comma-separated list of ids names; an unknown id is an error."""
    known = {patch.name.split()[0]: patch for patch in DIAGNOSTICS}
    wanted = [i.strip() for i in ids.split(",") if i.strip()]
    unknown = [i for i in wanted if i not in known]
    if unknown:
        raise ValueError(f"{DIAGNOSTICS_ENV} names unknown diagnostics {unknown}; known: {sorted(known)}")
    return [known[i] for i in wanted]


if __name__ != "__main__" and os.environ.get("VERL_USE_EXTERNAL_MODULES") == __name__:
    for _patch in (*PATCHES, *diagnostics_named(os.environ.get(DIAGNOSTICS_ENV, ""))):
        apply(_patch)
    print(f"[verl-alone patches] pid={os.getpid()} applied={APPLIED}", file=sys.stderr, flush=True)
