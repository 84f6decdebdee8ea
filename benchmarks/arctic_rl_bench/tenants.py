"""`arctic-rl bench tenants`: what time-sharing the engine costs a Tinker model (`--tinker-tenants N`).

Before a model's call runs, the engine holds that model's training state: the resident model is parked on disk
(`Backend.park_policy`: trainable weights and optimizer state) and the next one resumed (`resume_policy`), its
unstepped gradients rebuilt by running its `forward_backward` calls again. Measured on one backend in process, for
a LoRA job and a full-parameter one on the same model, side by side with one training step (fwd_bwd + step) of the
same batch: a switch between two models' states with no gradients pending, and with one fwd_bwd to rebuild. Beside
them, what a save for the sampler costs where the sampler holds one set of weights (`tinker/snapshots.py`): the
snapshot's write (`save_full_weights`) and its load into the sampler (`load_sampler_weights`), against a direct
`sync_weights`. Medians over repeats; each job in its own process.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def _size_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files) / 2**20


def worker(lora_rank: int, layers: int, hidden: int, repeats: int) -> dict:
    from arctic_rl_bench.zorro import build_batch
    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.models.tiny import make_tiny_model

    work = tempfile.mkdtemp(prefix="arctic-rl-bench-tenants-")
    model_dir = make_tiny_model("qwen3", os.path.join(work, "model"), layers=layers, hidden=hidden,
                                heads=max(hidden // 64, 1), kv_heads=max(hidden // 128, 1), max_positions=1024)
    engine = {"learning_rate": 1e-4, "micro_batch_tokens": 10**9}
    if lora_rank:
        engine["lora"] = {"r": lora_rank}
    api = InProcessBackend({"model_path": model_dir, "engine": engine, "sampler": {"name": "transformers"}})
    batch = build_batch(256, 64, 4, 2, api.engine.vocab_size)
    params = sum(p.numel() for p in api.engine.engine.module.parameters() if p.requires_grad)

    def step():
        api.fwd_bwd(batch, "grpo")
        api.step()

    a, b = os.path.join(work, "a"), os.path.join(work, "b")
    step()
    api.park_policy(b)  # model b's state: the policy after one step
    api.resume_policy(b, [])
    step()  # model a's, resident: after two

    def switch(pending: bool):
        """a out, b in; then b out, a in (timed as one switch each way, halved)."""
        if pending:
            api.fwd_bwd(batch, "grpo")
        calls = api.park_policy(a)
        api.resume_policy(b, [])
        api.park_policy(b)
        api.resume_policy(a, calls)
        if pending:
            api.discard_gradients()

    times: dict[str, list[float]] = {"step": [], "switch": [], "switch_with_pending": []}
    for fn in (lambda: switch(False), lambda: switch(True)):  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in (("step", step), ("switch", lambda: switch(False)),
                         ("switch_with_pending", lambda: switch(True))):
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            times[name].append(elapsed / 2 if name.startswith("switch") else elapsed)
    parked_mb = _size_mb(a)
    snapshot = os.path.join(work, "snapshot")
    for name in ("sync", "snapshot_save", "snapshot_load"):
        times[name] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        api.sync_weights()
        times["sync"].append(time.perf_counter() - t0)
        shutil.rmtree(snapshot, ignore_errors=True)
        t0 = time.perf_counter()
        api.save_full_weights(snapshot)
        times["snapshot_save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        api.load_sampler_weights(snapshot)
        times["snapshot_load"].append(time.perf_counter() - t0)
    snapshot_mb = _size_mb(snapshot)
    api.close()
    shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"job": f"LoRA r={lora_rank}" if lora_rank else "full parameter", "trainable_params": params,
            "parked_mb": parked_mb, "snapshot_mb": snapshot_mb, "seconds": medians, "raw_s": times,
            "switch_over_step": medians["switch"] / medians["step"],
            "switch_with_pending_over_step": medians["switch_with_pending"] / medians["step"]}


def run(lora_rank: int, layers: int, hidden: int, repeats: int) -> dict:
    from arctic_rl_bench.measure import run_worker

    return run_worker("arctic_rl_bench.tenants", str(lora_rank), str(layers), str(hidden), str(repeats))


def add_arguments(p) -> None:
    p.add_argument("--lora-rank", type=int, default=32, help="the LoRA job's rank (the other job trains all parameters)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    results = [run(rank, args.layers, args.hidden, args.repeats) for rank in (args.lora_rank, 0)]
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"Qwen3 {args.layers} layers, hidden {args.hidden}; GRPO step of 2 groups x 4, prompt 256, response 64; "
          f"medians of {args.repeats}")
    for r in results:
        s = r["seconds"]
        print(f"{r['job']:>15}: {r['trainable_params'] / 1e6:7.2f} M trainable, parked {r['parked_mb']:7.1f} MiB | "
              f"step {s['step']:.3f} s | switch {s['switch']:.3f} s (x{r['switch_over_step']:.2f} of a step) | "
              f"with one fwd_bwd to rebuild {s['switch_with_pending']:.3f} s (x{r['switch_with_pending_over_step']:.2f})"
              f" | sampler snapshot {r['snapshot_mb']:.1f} MiB: write {s['snapshot_save']:.3f} s, load "
              f"{s['snapshot_load']:.3f} s, against a direct sync {s['sync']:.3f} s")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, int, int, int, int)
