"""`arctic-rl bench sync`: time and GB/s of `sync_weights` per path and model size, beside memcpy.

Each (size, path) runs in its own process (one backend per process). In the
same process, the machine's plain memcpy of the same tensors into already
allocated buffers is measured as the yardstick. On CPU both of vLLM's weight
layouts are measured in process, each with the time of one fixed generation,
because the layout that syncs fast (plain) multiplies more slowly.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

# (sync, vLLM placement, CPU weight layout)
PATHS = (
    ("shared_memory", "in_process", "packed"),
    ("shared_memory", "in_process", "plain"),
    ("shared_memory", "subprocess", "plain"),
    ("shared_memory", "subprocess", "packed"),
    ("broadcast", "subprocess", "plain"),
    ("file", "in_process", "plain"),
)
CUDA_PATHS = (("shared_memory", "in_process", "plain"), ("broadcast", "subprocess", "plain"),
              ("file", "in_process", "plain"))  # vLLM on GPUs has one layout; no shared memory between processes
HIDDEN = (256, 1024, 2048)
ACROSS_NODES_HIDDEN = 1024
LAYERS = 4
# Timed generations, RL-shaped (a group of samples per prompt), at a small and a large decode batch
# (prompts x n sequences): oneDNN's packed kernels gain most on small ones.
GENERATION = {"decode_16": {"prompts": 4, "n": 4, "prompt_tokens": 64, "max_tokens": 32},
              "decode_128": {"prompts": 16, "n": 8, "prompt_tokens": 64, "max_tokens": 16}}


def worker(model_dir: str, sync: str, placement: str, layout: str, repeats: int) -> dict:
    import torch

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_bench.measure import median_seconds

    api = InProcessBackend({"model_path": model_dir, "sampler": {"name": "vllm", "sync": sync, "placement": placement,
                                                                 "kv_cache_mb": 256, "cpu_weight_layout": layout}})
    weights = [t.clone() for _, t in api.engine.named_full_weights()]
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    targets = [torch.empty_like(t) for t in weights]

    def memcpy():
        for src, dst in zip(weights, targets):
            dst.copy_(src)

    memcpy_s, _ = median_seconds(memcpy, repeats, warmup=2)
    sync_s, all_s = median_seconds(api.sync_weights, repeats, warmup=1)
    result = {"bytes": nbytes, "sync_s": sync_s, "sync_all_s": all_s, "memcpy_s": memcpy_s}
    if placement == "in_process" and sync == "shared_memory":
        result["generate_s"] = {}
        for name, g in GENERATION.items():
            prompts = [[(7 * p + t) % 200 + 3 for t in range(g["prompt_tokens"])] for p in range(g["prompts"])]
            params = {"n": g["n"], "max_tokens": g["max_tokens"], "temperature": 1.0, "seed": 0}
            result["generate_s"][name], _ = median_seconds(lambda: api.generate(prompts, params), repeats=3, warmup=1)
    return result


def run(repeats: int, hidden_sizes=HIDDEN) -> dict:
    import torch

    from arctic_rl_bench.measure import qwen3_of_width, run_worker

    cuda = torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in hidden_sizes:
            model_dir = qwen3_of_width(os.path.join(tmp, f"h{hidden}"), hidden, LAYERS)
            for sync, placement, layout in CUDA_PATHS if cuda else PATHS:
                r = run_worker("arctic_rl_bench.sync", model_dir, sync, placement, layout, str(repeats))
                rows.append({
                    "hidden": hidden, "layers": LAYERS, "params_mb": r["bytes"] / 2**20, "path": sync,
                    "placement": placement, "layout": "gpu" if cuda else layout,
                    "sync_s": r["sync_s"], "sync_gb_per_s": r["bytes"] / r["sync_s"] / 1e9,
                    "memcpy_gb_per_s": r["bytes"] / r["memcpy_s"] / 1e9,
                    "fraction_of_memcpy": r["memcpy_s"] / r["sync_s"], "raw_sync_s": r["sync_all_s"],
                    "generate_s": r.get("generate_s"),
                })
    return {"benchmark": "sync", "device": "cuda" if cuda else f"cpu x{torch.get_num_threads()}",
            "dtype": "float32", "repeats": repeats, "generation": GENERATION, "results": rows}


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, nargs="+", help="model widths (4 layers each); default: "
                   f"{' '.join(map(str, HIDDEN))}, or {ACROSS_NODES_HIDDEN} with --across-nodes")
    p.add_argument("--across-nodes", action="store_true",
                   help="a 2-rank, 2-replica job's sync to replicas on the ranks' node and on another, side by side "
                        "(arctic_rl_bench/sync_across_nodes.py)")
    p.add_argument("--address", help="with --across-nodes: a running Ray cluster (else 2 raylets on this machine)")
    p.add_argument("--trainer-node", default="node-a", help="with --address: the ranks' node, by its `name` label")
    p.add_argument("--other-node", default="node-b", help="with --address: the other node, by its `name` label")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    if args.across_nodes:
        from arctic_rl_bench import sync_across_nodes

        result = sync_across_nodes.run(args.repeats, args.hidden or [ACROSS_NODES_HIDDEN], LAYERS, args.address,
                                       args.trainer_node, args.other_node)
        if args.json:
            print(json.dumps(result))
        else:
            for r in result["results"]:
                print(f"hidden {r['hidden']:5d} ({r['model_mb']:.0f} MB)  {r['route']:<14} replicas {r['replicas']:<13}"
                      f"{r['sync_s'] * 1e3:8.1f} ms  {r['mb_per_s']:7.0f} MB/s")
        return 0
    result = run(args.repeats, args.hidden or HIDDEN)
    if args.json:
        print(json.dumps(result))
    else:
        for r in result["results"]:
            generation = "".join(f"  generate {name} {s:.2f} s" for name, s in (r["generate_s"] or {}).items())
            print(f"hidden {r['hidden']:5d} ({r['params_mb']:.0f} MB)  {r['path']:<14} {r['placement']:<11} "
                  f"{r['layout']:<7} {r['sync_s'] * 1e3:8.1f} ms  {r['sync_gb_per_s']:.2f} GB/s  "
                  f"= {r['fraction_of_memcpy']:.0%} of memcpy ({r['memcpy_gb_per_s']:.2f} GB/s){generation}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, str, str, str, str, int)
