"""The tiny text2sql recipe against a 2-rank, 2-replica job, chosen by configuration only (overrides), with
ZoRRo and async pipelining on as in the demo; it checkpoints across the ranks. (A 2-rank, 2-replica job resuming
from such a checkpoint, with the uninterrupted run's losses: tests/test_ray_cluster.py.)"""

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
    # Step 3's checkpoint (checkpoint.every=3): each rank's ZeRO optimizer shard, the model, the driver's state.
    saved = tmp_path / "run" / "checkpoints" / "step_000003"
    assert sorted(p.name for p in (saved / "state").glob("zero_pp_rank_*_optim_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]
    assert (saved / "state" / "mp_rank_00_model_states.pt").is_file()
    assert json.load(open(saved / "driver_state.json"))["step"] == 3
