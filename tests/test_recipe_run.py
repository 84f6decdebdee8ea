"""The driver end to end: a shortened tiny text2sql recipe on vLLM, with ZoRRo and async pipelining on.

Each run is its own `arctic-rl train` process (one in-process vLLM engine per process).
"""

import json
import os
import subprocess
import sys

import pytest

from arctic_rl_core.engines.distributed import standalone_env

GRPO_STEPS = 150
"""The recipe's full GRPO length: held-out accuracy gains 0.04-0.06 after 50 steps, within the evaluation's noise,
and 0.10-0.135 after 150 (docs/benchmarks.md, two machine draws)."""
SHORT = ["grpo.steps={steps}", "eval.every=0", "progress=false", "seed=0"]


def train(tmp_path, *overrides, steps: int) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "arctic_rl_core.cli", "train", "text2sql_tiny", f"output_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}", *[o.format(steps=steps) for o in SHORT], *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, env=standalone_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("recipe")
    proc = train(tmp_path, "checkpoint.every=25", steps=GRPO_STEPS)
    return tmp_path, proc


def rows(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_grpo_raises_held_out_execution_accuracy_over_the_sft_start(trained):
    tmp_path, proc = trained
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["accuracy_after_sft"] > summary["accuracy_start"]
    assert summary["accuracy_final"] >= summary["accuracy_after_sft"] + 0.05, summary
    assert "held-out accuracy" in proc.stdout


def test_metrics_tensorboard_plot_and_phases(trained):
    tmp_path, _ = trained
    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, GRPO_STEPS + 1))
    for key in ("reward", "accuracy", "response_length", "entropy", "kl", "clip_frac", "grad_norm", "tokens_per_s",
                "time/generate", "time/reward", "time/log_probs", "time/fwd_bwd", "time/step", "time/rollout_wait",
                "time/sync", "computed_tokens", "unshared_tokens", "peak_rss_gb"):
        assert all(key in r for r in train_rows if r["groups_trained"]), key
    # ZoRRo computed each group's shared prompt once; the peak memory is this process's, in GiB.
    assert all(r["computed_tokens"] < r["unshared_tokens"] for r in train_rows if r["groups_trained"])
    assert all(0.1 < r["peak_rss_gb"] < 64 for r in train_rows)
    # Pipelined with max_staleness 1: after the first step, batches were sampled one version behind.
    assert max(r["staleness"] for r in train_rows) == 1
    run = tmp_path / "run"
    assert os.path.getsize(run / "plot.png") > 10_000
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run / "tensorboard"))
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{GRPO_STEPS:06d}"]  # keep_last: 1


def test_resume_continues_from_the_newest_checkpoint(trained):
    tmp_path, _ = trained
    proc = train(tmp_path, "resume=auto", steps=GRPO_STEPS + 2)
    assert "resumed from" in proc.stdout + proc.stderr
    steps = [r["step"] for r in rows(tmp_path) if r["kind"] == "train"]
    assert steps == list(range(1, GRPO_STEPS + 3))  # the first run's steps, then two after the resume
