"""vLLM's engine core in a process of its own on CPU, its one worker inside it (vLLM's `UniProcExecutor`, as vLLM runs
one GPU), computing on the cores vLLM gives its own CPU worker.

vLLM 0.32 on CPU picks its multiprocessing executor, a worker process whose engine core spins while the worker
computes (on 2 cores that spin took the CPU from the worker and the server: 16 x 256 tokens 1.25x slower, measured,
docs/sampler.md). That worker's OpenMP threads are as many as the cores but `VLLM_CPU_NUM_OF_RESERVED_CPU` (one by
default), the one left to the engine core and the API server, or the cores `VLLM_CPU_OMP_THREADS_BIND` lists
(`vllm.utils.ompmultiprocessing`). `UniProcExecutor` does neither: the worker computed on as many threads as cores,
and the thread over took its core from the server's HTTP layer (on 2 cores, 32 streams took 1.3x as long as
`vllm serve`'s, docs/benchmarks.md). Here the worker computes as vLLM's would; `nobind` leaves it as it is. A weight
update runs on the same threads, so the packed sync of 148 MB takes 1.4x as long on 2 cores (123 against 87 ms). Run
on every core, it kept its speed but CI's Ray-cluster scenario then failed its resumed run's loss by 18% (repacked on
other threads than at load, likely other floats).
"""

from __future__ import annotations

import os

import torch
from vllm.utils.cpu_resource_utils import parse_id_list
from vllm.v1.executor.uniproc_executor import UniProcExecutor

RESERVED_CORES = 1
"""vLLM's default on x86 and Arm: one core per engine core process."""


def worker_cores(usable: int, environ=os.environ) -> tuple[int, list[int] | None] | None:
    """(threads, the cores they are bound to or None) as vLLM gives its CPU worker process; None: as they are."""
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "nobind":
        return None
    if bind != "auto":  # one list per worker, `|` between them: this engine has one worker
        cores = parse_id_list(bind.split("|")[0])
        return len(cores), cores
    reserved = int(environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or RESERVED_CORES)
    return max(1, usable - reserved), None


class WorkerInCore(UniProcExecutor):
    def _init_executor(self) -> None:
        # The worker computes on this thread (the core's busy loop calls it): its OpenMP threads are this thread's,
        # and start on its cores. vLLM's CPU worker refuses `torch.set_num_threads` once it has started.
        placed = worker_cores(len(os.sched_getaffinity(0)))
        if placed is not None:
            threads, cores = placed
            if cores is not None:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
        super()._init_executor()
