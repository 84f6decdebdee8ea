"""`arctic-rl bench generate`: the backend's own `generate` against vLLM's `LLM.generate`, same engine arguments.

Both sample one tiny Qwen3 from one folder with the same vLLM package and engine arguments (fp32, eager, KV-cache
bytes, prefix caching, whole-prompt prefills on CPU, seed, processed log-probs), every request `ignore_eos` at
temperature 1 with the sampled tokens' log-probs, so both sample the same number of tokens. Ours is
`InProcessBackend` (a DeepSpeed trainer beside the sampler, as in training) with the job's sampler settings
(`--side arctic:cpu_weight_layout=packed` changes one); vLLM's is `LLM` as its users build it, its engine core in
a process of its own, token ids out (no detokenizing, as ours).

One side runs at a time, each in a fresh process, so the two never share the machine; the order alternates
round by round. Per round each workload is timed `--repeats` times after a warm-up (median); the table reports
the median over rounds and each round's value.

Workloads: `1x512` (one request of 512 tokens alone), `8x256` (8 prompts of 256 tokens at once), `16x64` (a GRPO
group: one prompt, n=16, 64 tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# The engine arguments both sides share (`bench serve --vs-vllm` too).
KV_CACHE_MB = 512
MAX_MODEL_LEN = 2048
SEED = 0
PROMPT_TOKENS = 32
WORKLOADS = {"1x512": (1, 1, 512), "8x256": (8, 1, 256), "16x64": (1, 16, 64)}
"""name -> (prompts, n, tokens)."""
MODELS = {
    "compute": {"layers": 4, "hidden": 384, "heads": 6, "kv_heads": 2, "vocab_size": 1024},
    "tiny": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab_size": 512},
}
"""`compute`: large enough that the model's arithmetic, not the loop around it, is most of a step."""
GOAL = 1.05
"""Ours / vLLM's, on every workload (the generation issue's bound)."""


def _prompts(count: int, salt: int) -> list[list[int]]:
    return [[5 + (salt * 31 + p * 7 + j) % 400 for j in range(PROMPT_TOKENS)] for p in range(count)]


def _sampler_of(spec: str) -> dict:
    """`arctic` or `arctic:key=value,...`: the job's `sampler` section beyond the shared engine arguments."""
    settings = {}
    for item in filter(None, spec.partition(":")[2].split(",")):
        key, _, value = item.partition("=")
        settings[key] = value
    return settings


def _arctic(model: str, spec: str):
    from arctic_rl_core import SamplingParams
    from arctic_rl_core.backend import InProcessBackend

    api = InProcessBackend({"model_path": model, "engine": {"dtype": "float32", "seed": SEED},
                            "sampler": {"name": "vllm", "kv_cache_mb": KV_CACHE_MB, "max_model_len": MAX_MODEL_LEN,
                                        **_sampler_of(spec)}})

    def generate(prompts, n, tokens):
        done = api.generate(prompts, SamplingParams(n=n, max_tokens=tokens, temperature=1.0, ignore_eos=True))
        return sum(len(c.token_ids) for c in done)
    return generate, api.close


def _vllm(model: str):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_MB * 2**20,
              enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=False,
              max_num_batched_tokens=max(MAX_MODEL_LEN, 8192), seed=SEED, logprobs_mode="processed_logprobs")

    def generate(prompts, n, tokens):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
        done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for out in done for c in out.outputs)
    return generate, lambda: None


def worker(side: str, model: str, repeats: int, salt: int) -> dict:
    """One side's round: build, warm up, time each workload `repeats` times."""
    generate, close = _vllm(model) if side == "vllm" else _arctic(model, side)
    for prompts, n, _ in WORKLOADS.values():
        generate(_prompts(prompts, salt - 1), n, 8)
    out = {}
    for name, (prompts, n, tokens) in WORKLOADS.items():
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()
            sampled = generate(_prompts(prompts, salt * 100 + r), n, tokens)
            times.append(time.perf_counter() - t0)
            if sampled != prompts * n * tokens:
                raise RuntimeError(f"{side} sampled {sampled} tokens in {name}, not {prompts * n * tokens}")
        out[name] = {"seconds": statistics.median(times), "repeats": times}
    close()
    return out


def _round(side: str, model: str, repeats: int, salt: int) -> dict:
    from arctic_rl_bench.measure import run_worker

    return run_worker("arctic_rl_bench.generate", side, model, str(repeats), str(salt))


def run(sides: list[str], model_size: str, rounds: int, repeats: int) -> dict:
    from arctic_rl_core.models.tiny import make_tiny_model

    work = tempfile.mkdtemp(prefix="arctic-rl-bench-generate-")
    model = make_tiny_model("qwen3", os.path.join(work, "model"), max_positions=MAX_MODEL_LEN, **MODELS[model_size])
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            runs[side].append(_round(side, model, repeats, r))
    shutil.rmtree(work)
    result = {"benchmark": "generate", "model": {"size": model_size, **MODELS[model_size]}, "rounds": rounds,
              "repeats": repeats, "goal": GOAL, "workloads": {}}
    for name in WORKLOADS:
        row = {side: {"seconds": statistics.median(run[name]["seconds"] for run in rows),
                      "rounds": [run[name]["seconds"] for run in rows]} for side, rows in runs.items()}
        if "vllm" in row:
            for side in sides:
                if side != "vllm":
                    row[side]["vs_vllm"] = row[side]["seconds"] / row["vllm"]["seconds"]
        result["workloads"][name] = row
    return result


def add_arguments(p) -> None:
    p.add_argument("--side", dest="sides", action="append", default=None,
                   help="`vllm`, or `arctic` with sampler settings (`arctic:cpu_weight_layout=packed,placement="
                        "subprocess`); repeatable (default: arctic and vllm)")
    p.add_argument("--model", choices=list(MODELS), default="compute")
    p.add_argument("--rounds", type=int, default=3, help="each side started afresh per round; the order alternates")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per workload within a round (median)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    sides = args.sides or ["arctic", "vllm"]
    result = run(sides, args.model, args.rounds, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"InProcessBackend.generate vs vLLM LLM.generate, same engine arguments, {args.model} model "
          f"({MODELS[args.model]}); medians of {args.rounds} rounds x {args.repeats} repeats, one side at a time")
    for name, row in result["workloads"].items():
        for side, cell in row.items():
            ratio = f"  {cell['vs_vllm']:.3f}x vLLM (goal <= {GOAL})" if "vs_vllm" in cell else ""
            rounds = " ".join(f"{v:.3f}" for v in cell["rounds"])
            print(f"{name:<6} {side:<40} {cell['seconds']:.3f} s{ratio}   rounds: {rounds}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, str, str, int, int)
