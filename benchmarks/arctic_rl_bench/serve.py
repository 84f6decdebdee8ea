"""`arctic-rl bench serve`: what the OpenAI-compatible surface costs over calling `generate` directly.

One vLLM sampler (in its own process, as deployed) serves both sides: `api.generate` in process, and
`POST /v1/completions` (token-id prompts, `return_token_ids`) through a loopback server on a thread of
the same process wrapping the same backend. Three shapes, each side by side, medians over repeats:
- `single`: one prompt per call, calls one after another (the per-request overhead);
- `batch`: all prompts in one call (a list of prompts in one /v1/completions request);
- `concurrent`: one prompt per call, all calls at once from as many threads (how agent harnesses call).
Requests/s counts calls; tokens/s counts sampled tokens. The sides alternate within each repeat.
Every request, served or direct, joins the vLLM engine's running batch as its own call.

`--vs-vllm` compares the server with `vllm serve` instead (`arctic_rl_bench.serve_vs_vllm`).
"""

from __future__ import annotations

import json
import sys
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def worker(prompts: int, prompt_len: int, max_tokens: int, repeats: int) -> dict:
    import httpx

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="arctic-rl-bench-serve-"), hidden=256, heads=8,
                                kv_heads=2, layers=4, max_positions=2048)
    api = InProcessBackend({"model_path": model_dir, "sampler": {"name": "vllm", "kv_cache_mb": 256}})
    batch = [[5 + (p * 7 + i) % 400 for i in range(prompt_len)] for p in range(prompts)]
    sampling = {"max_tokens": max_tokens, "temperature": 1.0}
    results = {}
    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        http = httpx.Client(base_url=url, timeout=None, limits=httpx.Limits(max_connections=prompts))

        def direct(ps):
            return sum(len(c.token_ids) for c in api.generate(ps, sampling))

        def served(ps):
            body = {"model": model_dir, "prompt": ps if len(ps) > 1 else ps[0], "return_token_ids": True, **sampling}
            response = http.post("/v1/completions", json=body)
            response.raise_for_status()
            return sum(len(c["token_ids"]) for c in response.json()["choices"])

        def shapes(call):
            def single():
                return sum(call([p]) for p in batch[:8])

            def concurrent():
                with ThreadPoolExecutor(len(batch)) as pool:
                    return sum(pool.map(lambda p: call([p]), batch))
            return {"single": (single, 8), "batch": (lambda: call(batch), 1), "concurrent": (concurrent, len(batch))}

        sides = {"generate": shapes(direct), "completions": shapes(served)}
        for fns in sides.values():  # warm-up
            for fn, _ in fns.values():
                fn()
        times: dict = {}
        for _ in range(repeats):  # the sides alternate, so both see the same machine
            for side, fns in sides.items():
                for shape, (fn, calls) in fns.items():
                    t0 = time.perf_counter()
                    tokens = fn()
                    times.setdefault((shape, side), []).append((time.perf_counter() - t0, tokens, calls))
        for (shape, side), runs in times.items():
            seconds = statistics.median(t for t, _, _ in runs)
            tokens = statistics.median(n for _, n, _ in runs)
            results.setdefault(shape, {})[side] = {"seconds": seconds, "requests_per_s": runs[0][2] / seconds,
                                                   "tokens_per_s": tokens / seconds}
        counts = http.get("/v1/status").json()["serving"]
    for shape in results.values():
        shape["completions_vs_generate"] = shape["completions"]["tokens_per_s"] / shape["generate"]["tokens_per_s"]
    return {"benchmark": "serve", "prompts": prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "repeats": repeats, "sampler": "vllm (in process)", "results": results,
            "completions_requests": counts["requests"]["completions"], "sampler_calls": counts["generate_calls"]}


def run(prompts: int, prompt_len: int, max_tokens: int, repeats: int) -> dict:
    from arctic_rl_bench.measure import run_worker

    return run_worker("arctic_rl_bench.serve", str(prompts), str(prompt_len), str(max_tokens), str(repeats))


def add_arguments(p) -> None:
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None,
                   help="times each measurement runs, medians reported (default 5; --vs-vllm: per round, default 3)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--vs-vllm", action="store_true",
                   help="against `vllm serve` with the same engine arguments (the options below; the ones above "
                        "are not used)")
    p.add_argument("--rounds", type=int, default=3, help="--vs-vllm: alternating rounds, medians reported")
    p.add_argument("--workloads", nargs="+", default=None, help="--vs-vllm: a subset of the workloads")
    p.add_argument("--placement", choices=["subprocess", "in_process"], default=None,
                   help="--vs-vllm: our vLLM engine core in a process of its own (as vllm serve runs it) or in the "
                        "server's (default: the job's default, what `arctic-rl serve` chooses)")
    p.add_argument("--model", choices=["compute", "tiny"], default="compute",
                   help="--vs-vllm: a model whose arithmetic is most of a step, or a tiny one")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="--vs-vllm: each round starts only the server it measures, so the two never share the machine")


def main(args) -> int:
    if args.vs_vllm:
        from arctic_rl_bench import serve_vs_vllm

        return serve_vs_vllm.main(args)
    result = run(args.prompts, args.prompt_len, args.max_tokens, args.repeats or 5)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['prompts']} prompts x {result['prompt_len']} tokens, max_tokens {result['max_tokens']}, "
          f"{result['sampler']}; medians of {result['repeats']}")
    for shape, row in result["results"].items():
        g, c = row["generate"], row["completions"]
        print(f"{shape:<11} generate {g['requests_per_s']:8.1f} req/s {g['tokens_per_s']:8.0f} tok/s   "
              f"/v1/completions {c['requests_per_s']:8.1f} req/s {c['tokens_per_s']:8.0f} tok/s   "
              f"ratio {row['completions_vs_generate']:.2f}")
    print(f"{result['completions_requests']} /v1/completions requests went to the sampler in {result['sampler_calls']} calls")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, int, int, int, int)
