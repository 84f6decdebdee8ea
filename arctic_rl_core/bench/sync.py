"""`arctic-rl bench sync`: time and GB/s of `sync_weights` per path and model size, beside memcpy.

Each (size, path) runs in its own process (one backend per process). In the
same process, the machine's plain memcpy of the same tensors into already
allocated buffers is measured as the yardstick.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

PATHS = (("shared_memory", "in_process"), ("broadcast", "subprocess"), ("file", "in_process"))
SIZES = ((256, 4), (512, 4), (1024, 4))  # (hidden, layers)


def worker(model_dir: str, sync: str, placement: str, repeats: int) -> dict:
    import torch

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.bench.measure import median_seconds

    api = InProcessBackend({"model_path": model_dir, "sampler": {"name": "vllm", "sync": sync, "placement": placement,
                                                                 "kv_cache_mb": 64}})
    weights = [t.clone() for _, t in api.engine.named_full_weights()]
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    targets = [torch.empty_like(t) for t in weights]

    def memcpy():
        for src, dst in zip(weights, targets):
            dst.copy_(src)

    memcpy_s, _ = median_seconds(memcpy, repeats, warmup=2)
    sync_s, all_s = median_seconds(api.sync_weights, repeats, warmup=1)
    return {"bytes": nbytes, "sync_s": sync_s, "sync_all_s": all_s, "memcpy_s": memcpy_s}


def run(repeats: int) -> dict:
    import torch

    from arctic_rl_core.bench.measure import run_worker
    from arctic_rl_core.models.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden, layers in SIZES:
            model_dir = make_tiny_model("qwen3", os.path.join(tmp, f"h{hidden}"), hidden=hidden, layers=layers,
                                        heads=hidden // 64, kv_heads=max(1, hidden // 128), max_positions=512)
            for sync, placement in PATHS:
                r = run_worker("arctic_rl_core.bench.sync", model_dir, sync, placement, str(repeats))
                rows.append({
                    "hidden": hidden, "layers": layers, "params_mb": r["bytes"] / 2**20, "path": sync, "placement": placement,
                    "sync_s": r["sync_s"], "sync_gb_per_s": r["bytes"] / r["sync_s"] / 1e9,
                    "memcpy_gb_per_s": r["bytes"] / r["memcpy_s"] / 1e9,
                    "fraction_of_memcpy": r["memcpy_s"] / r["sync_s"], "raw_sync_s": r["sync_all_s"],
                })
    return {"benchmark": "sync", "device": "cuda" if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}",
            "dtype": "float32", "repeats": repeats, "results": rows}


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        for r in result["results"]:
            print(f"hidden {r['hidden']:5d} ({r['params_mb']:.0f} MB)  {r['path']:<14} {r['sync_s'] * 1e3:8.1f} ms  "
                  f"{r['sync_gb_per_s']:.2f} GB/s  = {r['fraction_of_memcpy']:.0%} of memcpy ({r['memcpy_gb_per_s']:.2f} GB/s)")
    return 0


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    from transformers.utils import logging as hf_logging

    from arctic_rl_core.engines.distributed import select_accelerator

    select_accelerator()
    hf_logging.disable_progress_bar()
    print(json.dumps(worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))), flush=True)
