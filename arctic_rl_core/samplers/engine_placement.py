"""Where a vLLM sampler's engine core runs: `sampler.placement` resolved for the machine at hand and for the way the
job runs, or refused before anything starts.

A server's HTTP layer and an engine core in its process take turns on one interpreter lock: measured on a 2-core
machine, a served job then answered 1.2-1.8x slower than `vllm serve`, whose engine core has a process of its own
(docs/benchmarks.md). A script's `InProcessBackend` has no HTTP layer, and keeps the engine beside the trainer, where
a weight sync is fastest; so does a GPU job syncing by `shared_memory` (CUDA tensors handed over in process).
"""

from __future__ import annotations

import os

import torch

from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import InvalidRequest

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch for its engine core's own process (on by default)."""
MIN_CORES = 2
"""An engine core of its own, its worker and the server: on one core they take turns at every step."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def resolved(config: BackendConfig, served: bool) -> BackendConfig:
    """`config` with `sampler.placement` chosen where it is `auto`, refused (by that setting) where it cannot start."""
    sampler = config.sampler
    placement = sampler.placement
    if placement == "auto":
        # A pool's replicas each run their engine in a Ray actor of their own; other samplers have no engine core.
        # On a GPU the trainer hands its tensors over in process; to a process of its own they go by `broadcast`.
        own_process = (served and sampler.name == "vllm" and sampler.replicas == 1 and usable_cores() >= MIN_CORES
                       and os.environ.get(MULTIPROCESSING_ENV, "1") == "1"
                       and (sampler.sync != "shared_memory" or not torch.cuda.is_available()))
        placement = "subprocess" if own_process else "in_process"
    elif placement == "subprocess" and sampler.name == "vllm" and sampler.replicas == 1:
        if os.environ.get(MULTIPROCESSING_ENV, "1") != "1":
            raise InvalidRequest("sampler.placement", f"subprocess, but {MULTIPROCESSING_ENV}="
                                 f"{os.environ[MULTIPROCESSING_ENV]} in this environment keeps vLLM's engine core in "
                                 "this process: unset it, or ask for in_process")
        if usable_cores() < MIN_CORES:
            raise InvalidRequest("sampler.placement", f"subprocess needs {MIN_CORES} or more cores (the engine core, "
                                 f"its worker and this process); this process may run on {usable_cores()}: "
                                 "ask for in_process (or auto)")
    if placement == sampler.placement:
        return config
    return config.model_copy(update={"sampler": sampler.model_copy(update={"placement": placement})})
