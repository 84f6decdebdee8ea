"""`arctic-rl bench update`: an adapter's actor update, with two forwards or with one.

A framework whose loss code reports metrics needs the policy's log-probs of the update's batch. Two ways
to get them, through the HTTP client to one server (the path an adapter takes), side by side:
- `two forwards`: `log_probs` (a no-grad forward), then `fwd_bwd` (the verl adapter before `return_logprobs`);
- `one forward`: `fwd_bwd(return_logprobs=True)`, the log-probs from the update's own forward.
Each repeat discards the gradients it accumulated, so every repeat updates from the same weights; the
two ways alternate within each repeat. GRPO, ZoRRo on, the tiny Qwen3 of the ZoRRo benchmark.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time


def worker(prompt_len: int, response_len: int, group: int, groups: int, repeats: int) -> dict:
    from arctic_rl_bench.zorro import build_batch
    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.config import BackendConfig
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="arctic-rl-bench-update-"), layers=4, hidden=256,
                                heads=4, kv_heads=2, max_positions=prompt_len + response_len)
    config = BackendConfig.model_validate({"model_path": model_dir, "sampler": {"name": "transformers"},
                                           "engine": {"zero_stage": 0, "micro_batch_tokens": 10**9}})
    seqs = build_batch(prompt_len, response_len, group, groups, 512)
    with ServerThread(ServerSettings(port=free_loopback_port(), max_request_bytes=2**30), config) as url:
        client = ArcticRLClient(url, retries=0)

        def two_forwards():
            client.log_probs(seqs, with_entropy=True)
            client.fwd_bwd(seqs, "grpo")

        def one_forward():
            client.fwd_bwd(seqs, "grpo", return_logprobs=True, with_entropy=True)

        ways = {"two_forwards": two_forwards, "one_forward": one_forward}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for fn in ways.values():  # warm-up
            fn()
            client.discard_gradients()
        for _ in range(repeats):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                client.discard_gradients()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"benchmark": "update", "prompt_len": prompt_len, "response_len": response_len, "group": group,
            "groups": groups, "repeats": repeats, "seconds": medians, "raw_s": times,
            "speedup": medians["two_forwards"] / medians["one_forward"]}


def run(prompt_len: int, response_len: int, group: int, groups: int, repeats: int) -> dict:
    from arctic_rl_bench.measure import run_worker

    return run_worker("arctic_rl_bench.update", str(prompt_len), str(response_len), str(group), str(groups), str(repeats))


def add_arguments(p) -> None:
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.prompt_len, args.response_len, args.group, args.groups, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["seconds"]
    print(f"{result['groups']} groups x {result['group']}, prompt {result['prompt_len']}, response {result['response_len']}; "
          f"medians of {result['repeats']}")
    print(f"two forwards (log_probs + fwd_bwd) {s['two_forwards']:.3f} s   one forward (fwd_bwd returning log-probs) "
          f"{s['one_forward']:.3f} s   x{result['speedup']:.2f}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, int, int, int, int, int)
