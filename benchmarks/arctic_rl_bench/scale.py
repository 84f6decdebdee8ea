"""`arctic-rl bench scale`: generate throughput with 1 vs 2 sampler replicas, fwd_bwd time with 1 vs 2
trainer ranks, what the Ray driver adds to a tiny call over the single-process path, and sync_weights.

Each job runs in its own process (one backend, one Ray per process), on the same tiny model, side by side
in one run; every number is a median over repeats.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

JOBS = {  # name: (engine.ranks, sampler.replicas, sampler.sync)
    "single process": (1, 1, "shared_memory"),
    "2 sampler replicas": (1, 2, "shared_memory"),
    "2 replicas, broadcast": (1, 2, "broadcast"),
    "2 trainer ranks": (2, 1, "shared_memory"),
}
GENERATE = {"prompts": 16, "n": 4, "prompt_tokens": 64, "max_tokens": 32}
FWD_BWD = {"groups": 8, "group_size": 4, "prompt_tokens": 128, "response_tokens": 64}


def worker(model_dir: str, ranks: int, replicas: int, sync: str, repeats: int) -> dict:
    import random

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_bench.measure import median_seconds

    api = InProcessBackend({"model_path": model_dir, "engine": {"ranks": ranks, "zero_stage": 2},
                            "sampler": {"name": "vllm", "replicas": replicas, "kv_cache_mb": 256, "sync": sync},
                            "ray": {"num_cpus": max(ranks, replicas)}})
    try:
        rng = random.Random(0)
        g = GENERATE
        prompts = [[rng.randrange(3, 500) for _ in range(g["prompt_tokens"])] for _ in range(g["prompts"])]
        sampling = {"n": g["n"], "max_tokens": g["max_tokens"], "temperature": 1.0, "seed": 0}
        generated = []
        generate_s, _ = median_seconds(lambda: generated.append(api.generate(prompts, sampling)), repeats)
        tokens = sum(len(c.token_ids) for c in generated[-1])  # seeded: the same completions every repeat
        f = FWD_BWD
        seqs = []
        for group in range(f["groups"]):
            prompt = [rng.randrange(3, 500) for _ in range(f["prompt_tokens"])]
            for _ in range(f["group_size"]):
                n = f["response_tokens"]
                seqs.append({"prompt_ids": prompt, "response_ids": [rng.randrange(3, 500) for _ in range(n)],
                             "group_id": group, "advantages": [rng.uniform(-1, 1)] * n,
                             "behaviour_logprobs": [-5.0] * n})

        def fwd_bwd():
            api.fwd_bwd(seqs, "grpo")
            api.discard_gradients()

        fwd_bwd_s, _ = median_seconds(fwd_bwd, repeats)
        tiny_seq = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "advantages": [1.0, 1.0],
                     "behaviour_logprobs": [-5.0, -5.0]}]

        def tiny_fwd_bwd():
            api.fwd_bwd(tiny_seq, "grpo")
            api.discard_gradients()

        tiny_fwd_bwd_s, _ = median_seconds(tiny_fwd_bwd, repeats * 4)
        tiny_generate_s, _ = median_seconds(lambda: api.generate([[5, 6, 7]], {"max_tokens": 1}), repeats * 4)
        sync_s, _ = median_seconds(api.sync_weights, repeats)
        return {"generate_s": generate_s, "generate_tokens_per_s": tokens / generate_s, "fwd_bwd_s": fwd_bwd_s,
                "tiny_fwd_bwd_s": tiny_fwd_bwd_s, "tiny_generate_s": tiny_generate_s, "sync_s": sync_s}
    finally:
        api.close()


def run(repeats: int, hidden: int) -> dict:
    from arctic_rl_bench.measure import qwen3_of_width, run_worker

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen3_of_width(os.path.join(tmp, "model"), hidden)
        for name, (ranks, replicas, sync) in JOBS.items():
            rows[name] = run_worker("arctic_rl_bench.scale", model_dir, str(ranks), str(replicas), sync, str(repeats))
    return {"benchmark": "scale", "cpus": os.cpu_count(), "hidden": hidden, "repeats": repeats,
            "generate": GENERATE, "fwd_bwd": FWD_BWD, "results": rows}


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=512, help="model width (4 layers)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.repeats, args.hidden)
    if args.json:
        print(json.dumps(result))
        return 0
    base = result["results"]["single process"]
    print(f"{result['cpus']} CPUs, hidden {result['hidden']}, medians of {result['repeats']} (tiny calls: x4)")
    for name, r in result["results"].items():
        print(f"{name:<22} generate {r['generate_s']:.3f} s ({r['generate_tokens_per_s']:.0f} tok/s, "
              f"x{base['generate_s'] / r['generate_s']:.2f})  fwd_bwd {r['fwd_bwd_s']:.3f} s "
              f"(x{base['fwd_bwd_s'] / r['fwd_bwd_s']:.2f})  tiny fwd_bwd {r['tiny_fwd_bwd_s'] * 1e3:.1f} ms "
              f"(+{(r['tiny_fwd_bwd_s'] - base['tiny_fwd_bwd_s']) * 1e3:.1f})  tiny generate "
              f"{r['tiny_generate_s'] * 1e3:.1f} ms (+{(r['tiny_generate_s'] - base['tiny_generate_s']) * 1e3:.1f})  "
              f"sync_weights {r['sync_s'] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, str, int, int, str, int)
