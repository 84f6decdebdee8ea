"""The runtime patches that let SkyRL 0.4 run alone (its FSDP2 policy worker, its vLLM servers behind its router) on
a CPU, and nothing more.

SkyRL has no hook that loads a module in every process (verl has `VERL_USE_EXTERNAL_MODULES`), so Python's own does:
skyrl_runner.py puts `skyrl_site/` (whose `sitecustomize` calls `apply_all`) and this folder on PYTHONPATH, which
Ray's workers and vLLM's processes inherit. A patch of one of SkyRL's or torch's modules waits for that module's
first import in a process (alone_patching), so that no process loads what it would not have loaded. Each patch says
why it is needed and why it does not change what the bench times; each process prints each patch that takes
effect in it, and the worker its torch threads (the runner keeps the lines).

Self-contained on purpose: the alone column imports nothing of Arctic RL.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

import alone_patching
from alone_patching import APPLIED, AlonePatch, AppliedTwice, BeforeImport, apply, when_imported  # noqa: F401 (the API)

TAG = "[skyrl-alone patches]"
MODEL_WRAPPER = "skyrl.backends.skyrl_train.workers.model_wrapper"
WORKERS = "skyrl.backends.skyrl_train.workers"
ROUTER_ARGS = "vllm_router.router_args"


def _took_effect(name: str) -> None:
    print(f"{TAG} pid={os.getpid()} in effect: {name}", file=sys.stderr, flush=True)


# -- S1: SkyRL's model wrapper imports flash-attn ------------------------------------------------------------------

def _flash_attn_unavailable(*args, **kwargs):
    raise RuntimeError("flash-attn is not installed (no CPU build): padding removal is off in the alone column")


class FlashAttnForModelWrapper(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`flash_attn.bert_padding` for SkyRL's model wrapper only, whose functions refuse to run. Any other importer
    (transformers asks whether flash-attn is installed) finds nothing, as before; appended to sys.meta_path, so an
    installed flash-attn wins."""

    NAMES = ("flash_attn", "flash_attn.bert_padding")

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.NAMES:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == MODEL_WRAPPER:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "flash_attn")
            frame = frame.f_back
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "flash_attn.bert_padding":
            module.pad_input = module.unpad_input = _flash_attn_unavailable
            _took_effect("S1 flash-attn-import")


def _flash_attn_import() -> None:
    sys.meta_path.append(FlashAttnForModelWrapper())


# -- S2: the router's arguments ------------------------------------------------------------------------------------

def _router_args_without_pd(module) -> None:
    if not hasattr(module.RouterArgs, "pd_disaggregation"):
        module.RouterArgs.pd_disaggregation = False
        _took_effect("S2 vllm-router-pd-flag")


def _router_pd_flag() -> None:
    when_imported(ROUTER_ARGS, _router_args_without_pd)


# -- S3: torch.cuda's calls in SkyRL's worker processes, answered for the CPU ------------------------------------------

def cuda_calls_on_the_cpu() -> None:
    """What SkyRL's FSDP worker asks of torch.cuda, answered for the CPU. Each replacement is a function of its own:
    torch.compile's trace rules key on their identity."""
    import psutil
    import torch
    import torch.distributed.device_mesh as device_mesh

    if torch.cuda.is_available():
        return
    cuda = torch.cuda

    def current_device():
        return "cpu"  # SkyRL moves tensors with .to(torch.cuda.current_device())

    def set_device(*args, **kwargs):
        pass

    def synchronize(*args, **kwargs):
        pass

    def empty_cache(*args, **kwargs):
        pass

    def memory_allocated(*args, **kwargs):
        return 0

    def memory_reserved(*args, **kwargs):
        return 0

    def max_memory_allocated(*args, **kwargs):
        return 0

    def mem_get_info(*args, **kwargs):
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    for function in (current_device, set_device, synchronize, empty_cache, memory_allocated, memory_reserved,
                     max_memory_allocated, mem_get_info):
        setattr(cuda, function.__name__, function)

    def stays_on_the_cpu(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = stays_on_the_cpu
    init_device_mesh = device_mesh.init_device_mesh

    def init_cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = init_cpu_device_mesh
    _took_effect("S3 cuda-calls-on-cpu")
    print(f"{TAG} pid={os.getpid()} torch threads: {torch.get_num_threads()}", file=sys.stderr, flush=True)


def _cuda_calls_on_the_cpu() -> None:
    sys.meta_path.insert(0, BeforeImport(WORKERS, cuda_calls_on_the_cpu))


# -- S4: the workers' process group ------------------------------------------------------------------------------

def gloo_process_group() -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        return
    init_process_group = dist.init_process_group

    def init_gloo_process_group(*args, backend=None, **kwargs):
        return init_process_group(*args, backend="gloo", **kwargs)

    dist.init_process_group = init_gloo_process_group
    _took_effect("S4 gloo-process-group")


def _gloo_process_group() -> None:
    sys.meta_path.insert(0, BeforeImport(WORKERS, gloo_process_group))


def _always() -> bool:
    return True  # each patch checks for a GPU when it takes effect: importing torch here would load it everywhere


PATCHES = (
    AlonePatch(
        "S1 flash-attn-import",
        why="SkyRL's FSDP model wrapper imports flash_attn.bert_padding at module level, and flash-attn has no CPU "
            "build; its functions serve padding removal only, which is off in the alone column (it needs flash-attn)",
        timing="nothing timed calls them: a call would raise",
        needed=_always, apply=_flash_attn_import),
    AlonePatch(
        "S2 vllm-router-pd-flag",
        why="SkyRL 0.4 reads RouterArgs.pd_disaggregation when its router starts, which vllm-router 0.1.17 (the "
            "newest on PyPI) does not define; without it the run fails before its first step",
        timing="read once, when the router starts",
        needed=_always, apply=_router_pd_flag),
    AlonePatch(
        "S3 cuda-calls-on-cpu",
        why="SkyRL's FSDP worker places tensors on torch.cuda.current_device(), builds its device meshes for 'cuda' "
            "and calls torch.cuda's sync, cache and memory functions, with no CPU path; in the processes that import "
            "SkyRL's workers (its entry point's and the workers'), not vLLM's, those calls answer for the CPU",
        timing="the sync, cache and memory calls do nothing on a CPU (nothing to wait for or free); tensors stay "
               "where they are, on the CPU",
        needed=_always, apply=_cuda_calls_on_the_cpu),
    AlonePatch(
        "S4 gloo-process-group",
        why="SkyRL's workers start their process group as 'cpu:gloo,cuda:nccl', and NCCL refuses to start without a "
            "GPU; plain gloo is the same backend for CPU tensors",
        timing="called once when a worker starts; one FSDP rank has no collectives on the hot path",
        needed=_always, apply=_gloo_process_group),
)


def listing() -> list[dict[str, str]]:
    return alone_patching.listing(PATCHES)


def apply_all() -> None:
    for patch in PATCHES:
        apply(patch)
