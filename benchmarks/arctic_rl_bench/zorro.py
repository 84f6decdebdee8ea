"""`arctic-rl bench zorro`: fwd_bwd and log_probs on one GRPO batch, ZoRRo off vs on, same engine.

`--turns T` makes each of the group's samples a multi-turn episode trained turn by turn (as captured
episodes are, `Episode.sequences`): turn k's prompt is the first prompt, then each earlier turn's
response and the environment's reply (half a response long), so ZoRRo shares the group's prompt and
each episode's history.

ZoRRo off (`--baseline padded`, the default) is plain batching as the peers do it: a right-padded batch,
one sequence per row, causal SDPA (flash attention on CPU and GPU), so attention costs per sequence
only. `--baseline packed` packs the same sequences unshared through ZoRRo's own kernels
(`--attention-backend`), so the two differ only in sharing. Each mode runs in its own process so that
peak memory is its own; the parent compares their log-probs and gradients.

`--preset qwen3-0.6b` is Qwen3-0.6B's shape with random weights (the long-prompt GPU rows of
docs/benchmarks.md); long sequences want `--gradient-checkpointing` and a `--micro-batch-tokens` budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import typing

from arctic_rl_bench.zorro_memory import longest
from arctic_rl_core.config import ZorroConfig

SEED = 1234
PRESET_POSITIONS = 40960
"""Qwen3-0.6B's own max_position_embeddings: the preset's model is built with it (longer batches extend it), so
every preset run up to that length can share one model (`--model-cache`)."""
SPEC = ("family", "preset", "layers", "hidden", "heads", "kv_heads", "prompt_len", "response_len", "turns", "group", "groups",
        "dtype", "attention_backend", "baseline", "micro_batch_tokens", "gradient_checkpointing", "repeats", "threads",
        "fit_lengths", "fp32_reference", "profile", "model_cache")


def build_batch(prompt_len: int, response_len: int, group: int, groups: int, vocab: int):
    from arctic_rl_core.types import Sequence

    rng = random.Random(SEED)
    seqs = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            seqs.append(
                Sequence(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(3, vocab) for _ in range(response_len)],
                    group_id=g,
                    advantages=[rng.uniform(-1, 1)] * response_len,
                    behaviour_logprobs=[-rng.uniform(4, 8) for _ in range(response_len)],
                )
            )
    return seqs


def build_episodes(prompt_len: int, response_len: int, turns: int, group: int, groups: int, vocab: int):
    """Per group, `group` episodes of `turns` turns from one prompt; one sequence per turn."""
    from arctic_rl_core.types import Sequence

    rng = random.Random(SEED)
    seqs = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            history = list(prompt)
            for _ in range(turns):
                response = [rng.randrange(3, vocab) for _ in range(response_len)]
                seqs.append(Sequence(prompt_ids=list(history), response_ids=response, group_id=g,
                                     advantages=[rng.uniform(-1, 1)] * response_len,
                                     behaviour_logprobs=[-rng.uniform(4, 8) for _ in range(response_len)]))
                history += response + [rng.randrange(3, vocab) for _ in range(response_len // 2)]
    return seqs


def _backend(mode: str, args: dict, checkpointing: bool, micro_batch_tokens: int | None):
    """One mode's backend: ZoRRo on, or off as the chosen baseline (packed unshared: no common prefix is as long
    as its sharing threshold); no budget means the whole batch in one micro-batch."""
    from arctic_rl_core.backend import InProcessBackend

    zorro = {"enable": mode == "zorro" or args["baseline"] == "packed", "attention_backend": args["attention_backend"],
             "min_shared_tokens": 1 if mode == "zorro" else 2**62}
    return InProcessBackend({
        "model_path": args["model_dir"],
        "engine": {"zero_stage": 0, "dtype": args["dtype"], "micro_batch_tokens": micro_batch_tokens or 10**9,
                   "grad_clip": None, "gradient_checkpointing": checkpointing},
        "zorro": zorro,
        # Nothing here samples: the lightest sampler (a vLLM engine would take start-up time and, on a GPU, half its
        # memory).
        "sampler": {"name": "transformers"},
    })


def worker(mode: str, args: dict, out_dir: str) -> dict:
    """Runs in a child process: one mode, timings, peak memory, outputs saved for comparison."""
    import torch
    from safetensors.torch import save_file

    from arctic_rl_bench.measure import current_rss_mb, median_seconds, peak_rss_mb

    torch.set_num_threads(args["threads"] or torch.get_num_threads())
    started = time.perf_counter()
    backend = _backend(mode, args, args["gradient_checkpointing"] == "on", args["micro_batch_tokens"])
    setup_s = time.perf_counter() - started
    vocab = backend.engine.vocab_size
    seqs = (build_batch(args["prompt_len"], args["response_len"], args["group"], args["groups"], vocab) if args["turns"] == 1
            else build_episodes(args["prompt_len"], args["response_len"], args["turns"], args["group"], args["groups"], vocab))
    cuda = torch.cuda.is_available()

    def mem_start():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        return current_rss_mb()

    def mem_peak(start):
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20 - start
        return peak_rss_mb() - start

    computed = {}

    def fwd_bwd():
        backend.discard_gradients()
        computed["tokens"] = backend.fwd_bwd(seqs, "grpo").computed_tokens
        if cuda:
            torch.cuda.synchronize()

    def log_probs():
        computed["logprobs"] = backend.log_probs(seqs).logprobs
        if cuda:
            torch.cuda.synchronize()

    # log_probs first: its peak is lower, and on CPU peak RSS never goes down.
    start = mem_start()
    lp_s, lp_all = median_seconds(log_probs, args["repeats"])
    lp_mem = mem_peak(start)
    logprobs = computed["logprobs"]  # the last timed call's
    start = mem_start()
    fb_s, fb_all = median_seconds(fwd_bwd, args["repeats"])
    fb_mem = mem_peak(start)
    # The parity check reads the accumulated gradients off the engine's module (there is no API call for them).
    module = backend.engine.engine.module
    grads = {n: p.grad.detach().float().cpu().contiguous() for n, p in module.named_parameters() if p.grad is not None}
    grads["__logprobs__"] = torch.tensor([x for row in logprobs for x in row])
    save_file(grads, os.path.join(out_dir, f"{args.get('save_as', mode)}.safetensors"))
    return {"setup_s": setup_s, "computed_tokens": computed["tokens"], "fwd_bwd_s": fb_s, "fwd_bwd_all_s": fb_all, "fwd_bwd_peak_mb": fb_mem,
            "log_probs_s": lp_s, "log_probs_all_s": lp_all, "log_probs_peak_mb": lp_mem,
            "profile": profile_ops(fwd_bwd, args.get("profile") or 0, cuda)}


def profile_ops(step, top: int, cuda: bool) -> list[dict] | None:
    """The `top` operators of one more call of `step` by their own time (device time on a GPU, else CPU), from
    torch.profiler: where a mode's step goes."""
    if not top:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    events = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in events) or 1
    return [{"op": e.key[:160], "calls": e.count, "ms": own(e) / 1e3, "share": own(e) / total}
            for e in sorted(events, key=own, reverse=True)[:top]]


def largest_without_checkpointing(mode: str, args: dict, out_dir: str) -> dict:
    """Runs in a child process: fwd_bwd of one mode without checkpointing, all in one micro-batch, at each of
    `args["fit_lengths"]` (responses an eighth of the prompt) in turn until the device runs out of memory; each
    length's measured peak beside the plan's estimate."""
    import torch
    from transformers import AutoConfig

    from arctic_rl_bench import zorro_memory

    backend = _backend(mode, args, checkpointing=False, micro_batch_tokens=None)
    config = AutoConfig.from_pretrained(args["model_dir"])
    dtype_bytes = 4 if args["dtype"] == "float32" else 2
    trials = []
    for prompt_len in args["fit_lengths"]:
        seqs = build_batch(prompt_len, prompt_len // 8, args["group"], args["groups"], backend.engine.vocab_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        try:
            backend.discard_gradients()
            backend.fwd_bwd(seqs, "grpo")
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            trials.append({"prompt_len": prompt_len, "fits": False})
            break
        computed = zorro_memory.tokens({**args, "prompt_len": prompt_len, "response_len": prompt_len // 8, "turns": 1}, mode)
        trials.append({"prompt_len": prompt_len, "fits": True, "peak_gb": (torch.cuda.max_memory_allocated() - start) / 1e9,
                       "estimate_gb": zorro_memory.activation_bytes(config, computed, dtype_bytes, False) / 1e9})
    fitting = [t["prompt_len"] for t in trials if t["fits"]]
    return {"largest_prompt_len": max(fitting, default=None), "trials": trials}


def _parameters(config) -> int:
    from arctic_rl_core.zorro.cost import linear_params_per_layer

    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers = text.num_hidden_layers * linear_params_per_layer(text.hidden_size, text.num_attention_heads,
                                                              text.num_key_value_heads, head_dim, text.intermediate_size)
    embeddings = text.vocab_size * text.hidden_size * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    return layers + embeddings


def model_dir(family: str, size: dict, positions: int, folder: str) -> str:
    """The random model of this family, size and length in `folder`: built there once and then reused (its weights
    are the same for the same arguments: `make_tiny_model` seeds them). Built under a temporary name and renamed
    into place, so a run stopped half way leaves no half-written model to reuse."""
    from arctic_rl_core.models.tiny import make_tiny_model

    key = hashlib.sha256(json.dumps([family, size, positions], sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(folder, f"{family}-{key}")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(folder, exist_ok=True)
        building = tempfile.mkdtemp(prefix=f".{family}-{key}-", dir=folder)
        make_tiny_model(family, building, max_positions=positions, **size)
        try:
            os.replace(building, path)
        except OSError:  # another run put the same model there first
            shutil.rmtree(building, ignore_errors=True)
    return path


def run(args: dict) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from arctic_rl_bench import zorro_memory
    from arctic_rl_bench.measure import run_worker
    from arctic_rl_core.models.tiny import QWEN3_0_6B
    from arctic_rl_core.zorro.cost import Shape, theoretical_speedup

    with tempfile.TemporaryDirectory() as tmp:
        args = dict(args)
        size = QWEN3_0_6B if args["preset"] == "qwen3-0.6b" else {k: args[k] for k in ("layers", "hidden", "heads", "kv_heads")}
        args.update({k: size[k] for k in ("layers", "hidden", "heads", "kv_heads")})  # the shape reported is the one run
        positions = max([longest(args)] + [p + p // 8 for p in args["fit_lengths"] or []])
        if args["preset"] == "qwen3-0.6b":
            positions = max(positions, PRESET_POSITIONS)
        started = time.perf_counter()
        args["model_dir"] = model_dir(args["family"], size, positions, args["model_cache"] or tmp)
        model_s = time.perf_counter() - started
        config = AutoConfig.from_pretrained(args["model_dir"])
        reference_args = {**args, "dtype": "float32", "repeats": 1, "save_as": "reference"}

        def planned(run_args: dict) -> dict | None:
            if not torch.cuda.is_available():
                return None
            chosen = zorro_memory.plan(config, run_args, torch.cuda.get_device_properties(0).total_memory,
                                       _parameters(config))
            run_args.update(gradient_checkpointing="on" if chosen["gradient_checkpointing"] else "off",
                            micro_batch_tokens=chosen["micro_batch_tokens"])
            return chosen

        def timed_worker(mode: str, run_args: dict) -> dict:
            started = time.perf_counter()
            result = run_worker("arctic_rl_bench.zorro", mode, json.dumps(run_args), tmp)
            return {**result, "worker_s": time.perf_counter() - started}

        memory = planned(args)
        if args["fit_lengths"]:
            if not torch.cuda.is_available():
                raise SystemExit("--largest-without-checkpointing measures a GPU's memory: it needs CUDA")
            return {"benchmark": "zorro largest prompt without checkpointing", "shape": {k: args[k] for k in SPEC},
                    "device": torch.cuda.get_device_name(0),
                    "model_s": model_s, "modes": {mode: timed_worker(f"fit:{mode}", args) for mode in ("naive", "zorro")}}
        results = {mode: timed_worker(mode, args) for mode in ("naive", "zorro")}
        naive, zorro = load_file(os.path.join(tmp, "naive.safetensors")), load_file(os.path.join(tmp, "zorro.safetensors"))
        reference = None
        if args["fp32_reference"] and args["dtype"] != "float32":
            # ZoRRo in fp32 (exact to the model's own fp32 forward): how far each 16-bit mode's gradients are from it.
            planned(reference_args)
            results["reference"] = timed_worker("zorro", reference_args)
            reference = load_file(os.path.join(tmp, "reference.safetensors"))
    lp_n, lp_z = naive.pop("__logprobs__"), zorro.pop("__logprobs__")
    g_n = torch.cat([naive[k].flatten() for k in sorted(naive)])
    g_z = torch.cat([zorro[k].flatten() for k in sorted(naive)])
    against_fp32 = None
    if reference is not None:
        lp_r = reference.pop("__logprobs__")
        g_r = torch.cat([reference[k].flatten() for k in sorted(naive)])
        against_fp32 = {"grad_rel_err": {"naive": float((g_n - g_r).norm() / g_r.norm()),
                                         "zorro": float((g_z - g_r).norm() / g_r.norm())},
                        "logprob_max_abs_err": {"naive": float((lp_n - lp_r).abs().max()),
                                                "zorro": float((lp_z - lp_r).abs().max())}}
    shape = Shape(args["prompt_len"], args["response_len"], args["group"], args["groups"])
    theory = theoretical_speedup(config, shape) if args["turns"] == 1 else None  # the FLOP model is single-turn
    n, z = results["naive"], results["zorro"]
    return {
        "benchmark": "zorro",
        "shape": {k: args[k] for k in SPEC if k not in ("repeats", "threads", "fit_lengths", "model_cache")},
        "memory_plan": memory,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads",
        "repeats": args["repeats"],
        "tokens_naive": n["computed_tokens"],
        "tokens_zorro": z["computed_tokens"],
        "naive_s": n["fwd_bwd_s"],
        "zorro_s": z["fwd_bwd_s"],
        "speedup": n["fwd_bwd_s"] / z["fwd_bwd_s"],
        "theory": theory,
        "logprob_max_abs_err": float((lp_n - lp_z).abs().max()),
        "grad_rel_err": float((g_n - g_z).norm() / g_n.norm()),
        "fp32_reference": against_fp32,
        "peak_mem_naive_mb": n["fwd_bwd_peak_mb"],
        "peak_mem_zorro_mb": z["fwd_bwd_peak_mb"],
        "log_probs": {
            "naive_s": n["log_probs_s"],
            "zorro_s": z["log_probs_s"],
            "speedup": n["log_probs_s"] / z["log_probs_s"],
            "theory": theory,
            "logprob_max_abs_err": float((lp_n - lp_z).abs().max()),
            "peak_mem_naive_mb": n["log_probs_peak_mb"],
            "peak_mem_zorro_mb": z["log_probs_peak_mb"],
        },
        "profile": {"naive": n["profile"], "zorro": z["profile"]} if args["profile"] else None,
        # Where the bench's own time went: building the model (none when --model-cache had it), and per worker
        # process its wall time and the backend's construction within it.
        "seconds": {"model": model_s, **{mode: {"worker": r["worker_s"], "setup": r["setup_s"]} for mode, r in results.items()}},
        "raw_s": {"naive": {"fwd_bwd": n["fwd_bwd_all_s"], "log_probs": n["log_probs_all_s"]},
                  "zorro": {"fwd_bwd": z["fwd_bwd_all_s"], "log_probs": z["log_probs_all_s"]}},
    }


def add_arguments(p) -> None:
    p.add_argument("--family", choices=["qwen3", "qwen2", "llama"], default="qwen3")
    p.add_argument("--preset", choices=["none", "qwen3-0.6b"], default="none",
                   help="a real model's shape with random weights (overrides --family and the size flags)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--turns", type=int, default=1, help="turns per episode (1: single-turn GRPO)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--attention-backend", choices=typing.get_args(ZorroConfig.model_fields["attention_backend"].annotation),
                   default="auto", help="ZoRRo's split attention (zorro.attention_backend)")
    p.add_argument("--baseline", choices=["padded", "packed"], default="padded",
                   help="ZoRRo off as a right-padded batch with SDPA, or packed unshared with ZoRRo's own kernels")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="the engine's token budget per micro-batch (default: all in one; on a GPU, what the memory plan needs)")
    p.add_argument("--gradient-checkpointing", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="auto: off on a CPU; on a GPU, on only where the activation estimate says the batch needs it")
    p.add_argument("--largest-without-checkpointing", dest="fit_lengths", type=int, nargs="*", default=None, metavar="P",
                   help="instead: the largest of these prompt lengths (default 1K to 32K; responses P/8) at which each "
                        "mode's fwd_bwd fits on this GPU without checkpointing, measured")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile one more fwd_bwd of each mode and report its N costliest operators")
    p.add_argument("--fp32-reference", action="store_true",
                   help="with a 16-bit --dtype: also run ZoRRo in fp32 and report both modes' distance from it")
    p.add_argument("--model-cache", default=None, metavar="DIR",
                   help="build the random model into DIR once and reuse it in later runs of the same shape (default: "
                        "a temporary folder, built each run)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    spec = {k: getattr(args, k) for k in SPEC}
    if spec["preset"] == "qwen3-0.6b":
        spec["family"] = "qwen3"
    if spec["fit_lengths"] == []:
        spec["fit_lengths"] = [1024 * 2**i for i in range(6)]
    if spec["model_cache"] and os.path.exists(spec["model_cache"]) and not os.path.isdir(spec["model_cache"]):
        raise SystemExit(f"--model-cache {spec['model_cache']}: not a folder")
    for name in ("prompt_len", "response_len", "turns", "group", "groups", "layers", "hidden", "repeats", "micro_batch_tokens"):
        if spec[name] is not None and spec[name] < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    result = run(spec)
    if args.json:
        print(json.dumps(result))
    elif spec["fit_lengths"]:
        for mode, fit in result["modes"].items():
            print(f"{mode}: largest prompt without checkpointing {fit['largest_prompt_len']}  " + "  ".join(
                f"P={t['prompt_len']}: " + (f"{t['peak_gb']:.1f} GB (est. {t['estimate_gb']:.1f})" if t["fits"] else "out of memory")
                for t in fit["trials"]))
    else:
        theory = f"theory {result['theory']:.2f}x" if result["theory"] else "no FLOP model for multi-turn"
        print(f"tokens:    naive {result['tokens_naive']}  zorro {result['tokens_zorro']}")
        print(f"fwd_bwd:   naive {result['naive_s']:.3f}s  zorro {result['zorro_s']:.3f}s  speedup {result['speedup']:.2f}x  "
              f"({theory})  peak MB {result['peak_mem_naive_mb']:.0f} -> {result['peak_mem_zorro_mb']:.0f}")
        lp = result["log_probs"]
        print(f"log_probs: naive {lp['naive_s']:.3f}s  zorro {lp['zorro_s']:.3f}s  speedup {lp['speedup']:.2f}x  "
              f"peak MB {lp['peak_mem_naive_mb']:.0f} -> {lp['peak_mem_zorro_mb']:.0f}")
        if result["memory_plan"]:
            plan = result["memory_plan"]
            print(f"memory plan: gradient checkpointing {'on' if plan['gradient_checkpointing'] else 'off'}, micro-batch "
                  f"tokens {plan['micro_batch_tokens'] or 'all'}, activations estimated " +
                  ", ".join(f"{mode} {gb:.1f} GB" for mode, gb in plan["estimate_gb"].items()))
        print(f"parity: logprob max abs err {result['logprob_max_abs_err']:.2e}, grad rel err {result['grad_rel_err']:.2e}")
        if result["fp32_reference"]:
            errors = result["fp32_reference"]["grad_rel_err"]
            print(f"gradients against fp32 ZoRRo: naive {errors['naive']:.2e}, zorro {errors['zorro']:.2e}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    def by_mode(mode: str, args: dict, out_dir: str) -> dict:
        kind, _, name = mode.rpartition(":")
        return (largest_without_checkpointing if kind == "fit" else worker)(name, args, out_dir)

    worker_main(by_mode, str, json.loads, str)
