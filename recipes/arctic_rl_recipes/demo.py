"""`arctic-rl demo` (`make demo`): the tiny text2sql recipe end to end, then its speed ratios.

It runs the bundled `text2sql_tiny` recipe with ZoRRo and async pipelining on
(SFT warm-up, held-out evaluation, GRPO with an execution-match reward against
real SQLite files), then, on the same backend in the same process, measures
seconds per GRPO step with ZoRRo on/off and synchronous/pipelined generation,
and prints a summary.
"""

from __future__ import annotations

import json
import os


def main(args) -> int:
    from arctic_rl_bench.e2e import VARIANTS, measure_variants
    from arctic_rl_recipes.config import load_recipe
    from arctic_rl_recipes.driver import RecipeRun
    from arctic_rl_recipes.run import print_summary, quiet_libraries

    config = load_recipe(args.recipe, [f"output_dir={args.output_dir}", *args.overrides])
    quiet_libraries()
    run = RecipeRun(config)
    try:
        summary = run.run()
        print("measuring seconds per GRPO step: ZoRRo on/off x synchronous/pipelined, same backend ...")
        speed = measure_variants(run, VARIANTS, rounds=args.rounds, steps=args.steps, first_step=config.grpo.steps + 1)
    finally:
        run.close()
    summary["speed"] = speed
    with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    sft, final = summary["accuracy_after_sft"], summary["accuracy_final"]
    print("\n== Arctic RL demo: GRPO on text-to-SQL (tiny Qwen3, CPU) ==")
    if sft is not None:
        print(f"held-out execution accuracy: after SFT {sft:.1%} -> after GRPO {final:.1%} ({(final - sft) * 100:+.1f} points)")
    print_summary(summary)
    per_step = speed["seconds_per_step"]
    print("seconds per GRPO step: " + ", ".join(f"{label} {s:.2f}" for label, s in per_step.items()))
    print(f"ZoRRo on/off speed-up (synchronous): {speed['zorro_on_off']:.2f}x; pipelined vs synchronous (ZoRRo on): "
          f"{speed['async_vs_sync']:.2f}x; ZoRRo+pipelined vs naive+synchronous: "
          f"{speed['speedup_vs_naive_sync']['zorro+async1']:.2f}x")
    print(f"summary: {os.path.join(config.output_dir, 'summary.json')}")
    return 0
