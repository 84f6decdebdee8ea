"""Timing and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def qwen3_of_width(path: str, hidden: int, layers: int = 4) -> str:
    """A tiny random Qwen3 whose size is set by its width: head dim 64, two query heads per KV head."""
    from arctic_rl_core.models.tiny import make_tiny_model

    return make_tiny_model("qwen3", path, hidden=hidden, layers=layers, heads=hidden // 64,
                           kv_heads=max(1, hidden // 128), max_positions=512)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1, cuda: bool = False) -> tuple[float, list[float]]:
    """Median (and all) of `repeats` timed calls after `warmup` untimed ones; with `cuda`, timed by CUDA
    events from an idle device, so the GPU's work counts, not only its launch."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            import torch

            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def worker_main(worker: Callable[..., dict], *types: Callable[[str], object]) -> None:
    """The `--worker` side of `run_worker`: `worker` on this process's arguments (each converted by its type),
    its result printed as the last JSON line; then the process ends (arctic_rl_core/process_exit.py)."""
    from transformers.utils import logging as hf_logging

    from arctic_rl_core.engines.distributed import select_accelerator
    from arctic_rl_core.process_exit import exit_now

    select_accelerator()
    hf_logging.disable_progress_bar()
    print(json.dumps(worker(*(convert(arg) for convert, arg in zip(types, sys.argv[2:], strict=True)))), flush=True)
    exit_now(0)


def run_worker(module: str, *args: str) -> dict:
    """Run `python -m module --worker args...` in a process of its own; return the JSON line it prints last.

    Each worker is a world of one (one backend per process): it must not join this process's
    torch.distributed rendezvous.
    """
    from arctic_rl_core.engines.distributed import standalone_env

    proc = subprocess.run([sys.executable, "-m", module, "--worker", *args], capture_output=True, text=True,
                          env=standalone_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} worker {' '.join(args[:1])} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
