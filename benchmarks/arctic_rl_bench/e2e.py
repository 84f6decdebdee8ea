"""`arctic-rl bench e2e`: seconds per GRPO step of the tiny text2sql recipe, per variant, side by side.

Variants differ in ZoRRo (on/off) and pipelining (`max_staleness` 0 or 1); they
share one process, one backend (one engine, one vLLM) and the same seed and
shapes. Rounds interleave the variants so that machine noise and the slow drift
of the policy (response lengths) fall on all of them alike; the first step of
each segment fills the pipeline and is not counted. Every measured step trains on all its
samples (no group is skipped for uniform rewards), so the variants do equal work. Reported: median seconds per
step and per phase, and ratios against naive+sync.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

from arctic_rl_recipes.driver import PhaseTimer, RecipeRun, Variant

VARIANTS = (Variant(False, 0), Variant(True, 0), Variant(False, 1), Variant(True, 1))


def measure_variants(run: RecipeRun, variants=VARIANTS, *, rounds: int, steps: int, first_step: int = 1,
                     log=print) -> dict:
    """Run `rounds` x `steps` (+1 warm-up) GRPO steps of each variant on `run`'s backend; medians and ratios."""
    api = run.api
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    phases: dict[str, list[dict[str, float]]] = {v.label: [] for v in variants}
    step = first_step
    for r in range(rounds):
        for variant in variants:
            api.config.zorro.enable = variant.zorro  # the backend reads its config at every call
            pipe = run.pipeline(step, variant.max_staleness)
            try:
                for i in range(steps + 1):
                    t0 = time.perf_counter()
                    timer = PhaseTimer()
                    with timer("generate"):
                        batch = pipe.next_batch()
                    run.grpo_step(step + i, batch, timer, pipe, train_all=True)
                    if i:  # step 0 fills the pipeline
                        times[variant.label].append(time.perf_counter() - t0)
                        phases[variant.label].append(timer.seconds)
            finally:
                pipe.close()
            step += steps + 1
            log(f"round {r + 1}/{rounds} {variant.label:<12} median {statistics.median(times[variant.label][-steps:]):.3f} s/step")
    api.config.zorro.enable = run.config.backend.zorro.enable
    medians = {label: statistics.median(t) for label, t in times.items()}
    base = medians.get("naive+sync")
    result = {
        "seconds_per_step": medians,
        "seconds_per_phase": {label: {p: statistics.median(s[p] for s in rows) for p in rows[0]}
                              for label, rows in phases.items()},
        "steps_measured": {label: len(t) for label, t in times.items()},
    }
    if base:
        result["speedup_vs_naive_sync"] = {label: base / m for label, m in medians.items()}
    if "zorro+sync" in medians and base:
        result["zorro_on_off"] = base / medians["zorro+sync"]
    if "zorro+sync" in medians and "zorro+async1" in medians:
        result["async_vs_sync"] = medians["zorro+sync"] / medians["zorro+async1"]
    return result


def add_arguments(p) -> None:
    p.add_argument("--recipe", default="text2sql_tiny", help="recipe file or bundled name")
    p.add_argument("--schema-rows", type=int, default=12, help="example rows per table in the prompt (longer prompts)")
    p.add_argument("--sft-steps", type=int, default=60, help="warm-up so that groups get mixed rewards")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="measured steps per variant per round")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="recipe overrides, key.path=value")


def main(args) -> int:
    import torch

    from arctic_rl_recipes.config import load_recipe
    from arctic_rl_recipes.run import quiet_libraries

    out = args.output_dir or tempfile.mkdtemp(prefix="arctic-rl-bench-e2e-")
    overrides = [f"task.schema_rows={args.schema_rows}", f"sft.steps={args.sft_steps}", f"output_dir={out}",
                 f"model.path={out}/model", "progress=false", *args.overrides]
    config = load_recipe(args.recipe, overrides)
    quiet_libraries()
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    run = RecipeRun(config, log=log)
    try:
        run.connect()
        run.sft(config.sft.steps)
        result = measure_variants(run, rounds=args.rounds, steps=args.steps, log=log)
    finally:
        run.close()
    prompt_tokens = statistics.mean(len(p) for p in run.train_prompts)
    result.update({
        "benchmark": "e2e", "recipe": args.recipe, "overrides": overrides,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads",
        "mean_prompt_tokens": prompt_tokens, "group_size": config.grpo.group_size,
        "prompts_per_step": config.grpo.prompts_per_step, "date": time.strftime("%Y-%m-%d"),
    })
    if args.json:
        print(json.dumps(result))
    else:
        for label, seconds in result["seconds_per_step"].items():
            print(f"{label:<13} {seconds:.3f} s/step  x{result['speedup_vs_naive_sync'][label]:.2f} vs naive+sync  "
                  + " ".join(f"{p} {s:.3f}" for p, s in result["seconds_per_phase"][label].items()))
    return 0
