"""`arctic-rl train RECIPE.yaml [key.path=value ...]`."""

from __future__ import annotations

import json
import os
import sys

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.patches import environment_default


def quiet_libraries() -> None:
    """The driver prints its own progress; keep the engines' start-up logs out of it."""
    environment_default("VLLM_LOGGING_LEVEL", "ERROR", "vLLM: the driver prints its own progress", __name__)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def print_summary(summary: dict) -> None:
    phases = ", ".join(f"{p.replace('_', ' ')} {s:.2f}s" for p, s in summary["median_seconds_per_phase"].items())
    acc = {k: summary[k] for k in ("accuracy_start", "accuracy_after_sft", "accuracy_final")}
    print("held-out accuracy: " + ", ".join(f"{k.removeprefix('accuracy_')} {v:.3f}" for k, v in acc.items() if v is not None))
    if summary["median_seconds_per_step"] is not None:
        print(f"median seconds per GRPO step {summary['median_seconds_per_step']:.2f} ({phases})")
    print(f"metrics: {summary['metrics']}\ntensorboard: {summary['tensorboard']}\nplot: {summary['plot']}")


def main(args) -> int:
    from arctic_rl_recipes.config import load_recipe
    from arctic_rl_recipes.driver import RecipeRun

    try:
        config = load_recipe(args.recipe, args.overrides)
        quiet_libraries()
        run = RecipeRun(config)
    except InvalidRequest as err:
        print(f"arctic-rl train: {err}", file=sys.stderr)
        return 2
    try:
        summary = run.run()
    finally:
        run.close()
    print_summary(summary)
    print(json.dumps({"summary": os.path.join(config.output_dir, "summary.json")}))
    return 0
