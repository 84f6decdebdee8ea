"""A CPU platform for verl 0.9.1, which ships only nvidia, huawei and amd ones.

With Arctic RL all GPU work happens in the backend, so verl's controller and workers
can run on machines without GPUs. verl probes registered platforms in order and this
one last, so it is chosen only where no accelerator is found.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


class _CPUDeviceModule:
    """torch.cpu plus the torch.cuda-style memory/RNG calls verl makes via get_torch_device()."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def is_available(self):
        return True

    def empty_cache(self):
        pass

    def ipc_collect(self):
        pass

    def memory_allocated(self, *a, **k):
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, *a, **k):
        pass

    def mem_get_info(self, *a, **k):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_rng_state(self, *a, **k):
        return torch.get_rng_state()

    def set_rng_state(self, state, *a, **k):
        torch.set_rng_state(state)

    def set_per_process_memory_fraction(self, *a, **k):
        pass

    def get_device_name(self, *a, **k):
        return "cpu"


_CPU_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Probed after nvidia/huawei/amd (registration order): chosen only when none of them is there.
        return os.getenv("ARCTIC_RL_VERL_CPU_PLATFORM", "1") != "0"

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # verl's ResourcePoolManager hard-codes use_gpu=True and counts "GPU"/"NPU"
        # resources, so on CPU hosts start Ray with logical GPUs (ray.init(num_gpus=N)).
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
