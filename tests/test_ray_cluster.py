"""One job across the nodes of a Ray cluster, started with Ray's own tools (`ray start`) as a user's cluster is:
four raylets on this machine (`arctic_rl_bench.local_cluster`), a head, a worker labelled `role=trainer` and two
labelled `role=sampler`, each with its own logical CPUs. The tiny text2sql recipe joins it by `ray.address`, its
two trainer ranks on the trainer node and its two sampler replicas on a sampler node (`placement: disaggregated`,
chosen by node labels). It trains exactly as the same job on one node; it loses its trainer node, stops saying so,
and its last checkpoint resumes on the nodes left with the one-node run's losses; the resumed job loses a sampler
node under it and finishes every step on the other. The nodes are stopped by process group, bounded in time,
whatever the tests did."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from arctic_rl_bench.local_cluster import RAY, local_cluster
from arctic_rl_core.engines.distributed import standalone_env
from test_recipe_run import SHORT, rows, train

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

NODES = {"head": (2, {}), "trainer": (2, {"role": "trainer"}), "sampler-a": (2, {"role": "sampler"}),
         "sampler-b": (2, {"role": "sampler"})}
"""Each node's logical CPUs and labels (each also has its name as label `name`)."""
JOB = ["backend.engine.ranks=2", "backend.sampler.replicas=2", "backend.placement=disaggregated",
       "pipeline.max_staleness=0", "eval.max_examples=16", "checkpoint.every=0"]
ON_THE_CLUSTER = ["backend.ray.trainer_nodes.labels.role=trainer", "backend.ray.sampler_nodes.labels.role=sampler"]
STEPS = 2
"""The steps the job on the cluster takes before it loses its trainer node (while step STEPS + 1 samples)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The 4-node cluster the module shares, with a dashboard on the head for `ray job submit`."""
    with local_cluster(tmp_path_factory.mktemp("ray-cluster"), NODES, dashboard=True) as started:
        yield started


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The job on one node (a local Ray), uninterrupted, one step past where the job on the cluster is stopped: its
    run directory."""
    run = tmp_path_factory.mktemp("one-node")
    train(run, *JOB, "backend.ray.num_cpus=4", steps=STEPS + 1)
    return run


def losses(records: list[dict]) -> dict:
    sft = next(r for r in records if r.get("phase") == "after_sft")
    return {"sft": [sft["sft_loss_first"], sft["sft_loss_last"]],
            "grpo": [r["loss"] for r in records if r["kind"] == "train" and r["groups_trained"]],
            "reward": [r["reward"] for r in records if r["kind"] == "train"]}


@pytest.mark.parametrize("ray_settings, field, says", [
    ({"trainer_nodes": {"labels": {"role": "critic"}}}, "ray.trainer_nodes.labels",
     "no live node of the cluster carries {'role': 'critic'} (its nodes' labels: name=head, name=sampler-a, "
     "name=sampler-b, name=trainer, role=sampler, role=trainer)"),
    ({"sampler_nodes": {"resources": {"inference_slot": 1}}}, "ray.sampler_nodes.resources",
     "2 inference_slot needed, the cluster has 0"),
    ({"trainer_nodes": {"labels": {"role": "trainer"}}, "ranks": 3}, "engine.ranks",
     "3 CPU needed, the 1 node(s) carrying {'role': 'trainer'} have 2 (2 free)"),
], ids=["labels", "resources", "cpus"])
def test_a_job_the_cluster_cannot_place_is_refused_at_once_naming_the_setting(cluster, tiny_model, ray_settings,
                                                                              field, says):
    import ray

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.errors import InvalidRequest

    address = cluster.address
    settings = dict(ray_settings)
    ranks = settings.pop("ranks", 2)
    cfg = {"model_path": tiny_model, "placement": "disaggregated", "engine": {"ranks": ranks},
           "sampler": {"name": "transformers", "replicas": 2}, "ray": {"address": address, **settings}}
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as err:
        InProcessBackend(cfg)
    assert err.value.field == field and says in str(err.value), str(err.value)
    assert time.monotonic() - started < 60  # not ray.start_timeout_s (120 s): the cluster's nodes were read
    assert not ray.is_initialized()  # the driver left the cluster
    ray.init(address=address, logging_level="ERROR")
    try:  # and left nothing on it: every CPU of every node is free once Ray has removed its placement groups
        cpus = sum(cpus for cpus, _ in NODES.values())
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] == cpus
    finally:
        ray.shutdown()


def actor_pids(name: bytes) -> list[int]:
    """The processes of this machine whose title is Ray's for an actor of class `name` (b"SamplerReplica")."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::" + name):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


RESUMED_STEPS = STEPS + 2
"""The resumed job's last step: it loses a sampler node after its first step (step STEPS + 1)."""


def submitted(job: list[str], log, *overrides: str) -> subprocess.Popen:
    """A job sent with `ray job submit` to the head's job server, as docs/placement.md sends it."""
    return subprocess.Popen([*job, *overrides], stdout=log, stderr=subprocess.STDOUT, env=standalone_env())


def wait_for(proc: subprocess.Popen, done, log_file, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None and time.monotonic() < deadline, log_file.read_text()[-4000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def nodes_lost(cluster, one_node, tmp_path_factory):
    """The job on the cluster, and both losses, each at a step of its own. The job trains STEPS steps with its ranks
    on the trainer node and its replicas on a sampler node (where their processes run, read from each node's
    process tree), then loses its trainer node once step STEPS's checkpoint is written, while the next step samples,
    and stops. A new job resumes from that checkpoint on the nodes left (ranks on the head, replicas on a sampler
    node) and, once its first step is in, loses the node holding its replicas while the next step samples: it
    finishes every step on the other sampler node. The module's evidence; it takes two nodes away from the cluster
    the module shares, so the tests that need them all run before it."""
    nodes = cluster.nodes
    run = tmp_path_factory.mktemp("nodes-lost")
    job = [RAY, "job", "submit", f"--address={cluster.dashboard}", "--", sys.executable, "-m", "arctic_rl_core.cli",
           "train", "text2sql_tiny", f"output_dir={run / 'run'}", f"model.path={one_node / 'model'}",
           *[o.format(steps=RESUMED_STEPS) for o in SHORT], *JOB, "checkpoint.every=1", "backend.ray.address=auto"]
    found = {}
    first, resumed = run / "submit.log", run / "resumed.log"
    with open(first, "w") as log:
        proc = submitted(job, log, *ON_THE_CLUSTER)
        try:
            wait_for(proc, (run / "run" / "checkpoints" / f"step_{STEPS:06d}" / "driver_state.json").exists, first)
            found["placed"] = {actor: sorted(name for name, node in nodes.items() for pid in actor_pids(actor.encode())
                                             if node.holds(pid)) for actor in ("TrainerRank", "SamplerReplica")}
            nodes["trainer"].stop(first=signal.SIGKILL)  # its raylet and the ranks killed, as a machine that goes away
            lost = time.monotonic()
            found["first_exit"] = proc.wait(timeout=300)
            found["stopped_in"] = time.monotonic() - lost
        finally:
            if proc.poll() is None:
                proc.kill()
    found["before_resuming"] = rows(run)

    with open(resumed, "w") as log:
        proc = submitted(job, log, "resume=auto", "backend.ray.trainer_nodes.labels.name=head",
                         "backend.ray.sampler_nodes.labels.role=sampler")
        try:
            wait_for(proc, lambda: any(r["kind"] == "train" and r["step"] == STEPS + 1 for r in rows(run)), resumed)
            holding = [name for name, node in nodes.items()
                       if any(node.holds(pid) for pid in actor_pids(b"SamplerReplica"))]
            found["sampler_lost"] = holding
            if len(holding) == 1:
                nodes[holding[0]].stop(first=signal.SIGKILL)
            found["resumed_exit"] = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    found["said"], found["resumed_said"] = first.read_text(), resumed.read_text()
    return run, found


def test_ranks_on_one_node_and_replicas_on_another_train_exactly_as_on_one_node(cluster, one_node, nodes_lost):
    _, found = nodes_lost

    # Where each actor ran: ranks on the trainer node, replicas on a sampler node.
    placed = found["placed"]
    assert placed["TrainerRank"] == ["trainer"] * 2, placed
    assert placed["SamplerReplica"] in (["sampler-a"] * 2, ["sampler-b"] * 2), placed  # PACK
    local = json.load(open(one_node / "run" / "summary.json"))["placement"]
    assert len({row["node_id"] for row in local["trainer"] + local["sampler"]}) == 1, local

    # The same losses, step by step (fp32): the cluster changes where the work runs, not what it computes.
    here, there = losses(rows(one_node)), losses(found["before_resuming"])
    assert len(there["grpo"]) == STEPS  # each step had groups with mixed rewards, so each trained
    for key in ("sft", "grpo", "reward"):
        assert there[key] == pytest.approx(here[key][: len(there[key])], rel=1e-5, abs=1e-7), (key, here, there)


def test_a_sampler_node_lost_mid_run_costs_no_step_and_no_sample(cluster, nodes_lost):
    run, found = nodes_lost
    lost = found["sampler_lost"]
    assert len(lost) == 1 and lost[0].startswith("sampler"), lost
    assert found["resumed_exit"] == 0, found["resumed_said"][-4000:]
    train_rows = [r for r in rows(run) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, RESUMED_STEPS + 1))
    # Every step sampled its whole batch: 16 prompts x 8 samples, none dropped or lost with the node.
    assert [r["samples"] for r in train_rows] == [16 * 8] * RESUMED_STEPS
    assert all(r["groups_trained"] + r["groups_uniform"] == 16 and r["dropped"] == 0 for r in train_rows)
    # The replicas were replaced on the sampler node that survived.
    (survivor,) = {"sampler-a", "sampler-b"} - set(lost)
    sampler = json.load(open(run / "run" / "summary.json"))["placement"]["sampler"]
    assert [row["node_id"] for row in sampler] == [cluster.ids[survivor]] * 2, sampler
    assert all(row["replacements"] >= 1 for row in sampler), sampler


def test_a_trainer_node_lost_stops_the_job_saying_so_and_its_checkpoint_resumes_on_the_nodes_left(
        cluster, one_node, nodes_lost):
    ids = cluster.ids
    run, found = nodes_lost
    # The job fails with an error that says what happened and what to do, well within ray.call_timeout_s.
    said = found["said"]
    assert found["first_exit"] == 1, said[-4000:]
    # Ray may not have declared the node dead yet when the next call finds the ranks gone.
    assert re.search(rf"trainer rank \d on node \S+ \({ids['trainer']}\) (died|is unreachable)", said), said[-4000:]
    assert "load_checkpoint to resume from the last checkpoint" in said
    assert found["stopped_in"] < 120, found["stopped_in"]
    print(f"the job stopped {found['stopped_in']:.1f} s after its trainer node was lost")
    assert [r["step"] for r in found["before_resuming"] if r["kind"] == "train"] == list(range(1, STEPS + 1))

    # The new job on the nodes left resumed from step STEPS's checkpoint, its ranks on the head, and its first step
    # is the uninterrupted one-node run's: the same batch sampled, the same loss (fp32).
    assert found["resumed_exit"] == 0, found["resumed_said"][-4000:]
    assert "resumed from " + str(run / "run" / "checkpoints" / f"step_{STEPS:06d}") in found["resumed_said"]
    placement = json.load(open(run / "run" / "summary.json"))["placement"]
    assert [row["node_id"] for row in placement["trainer"]] == [ids["head"]] * 2, placement
    here, there = losses(rows(one_node)), losses(rows(run))
    for key in ("sft", "grpo", "reward"):
        steps = len(here[key])  # the one-node run's: its SFT, then its STEPS + 1 GRPO steps
        assert there[key][:steps] == pytest.approx(here[key], rel=1e-5, abs=1e-7), (key, here, there)
