"""The tiny text2sql recipe against a 2-rank, 2-replica job, chosen by configuration only (overrides), with
ZoRRo and async pipelining on as in the demo; it checkpoints across the ranks and resumes from them."""

import json

import pytest

from test_recipe_run import rows, train

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

DISTRIBUTED = ["backend.engine.ranks=2", "backend.sampler.replicas=2", "backend.placement=colocated",
               "backend.ray.num_cpus=2", "sft.steps=5", "checkpoint.every=3", "eval.max_examples=32"]


def test_text2sql_recipe_runs_on_two_ranks_and_two_replicas_by_configuration(tmp_path):
    train(tmp_path, *DISTRIBUTED, steps=3)
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["grpo_steps"] == 3, summary
    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(r["weight_version"] >= 1 for r in train_rows[1:])

    proc = train(tmp_path, *DISTRIBUTED, "resume=auto", steps=4)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in rows(tmp_path) if r["kind"] == "train"] == [1, 2, 3, 4]
