"""One job across the nodes of a Ray cluster, started with Ray's own tools (`ray start`) as a user's cluster is:
two raylets on this machine, a head labelled `role=trainer` and a worker labelled `role=sampler`, each with its
own logical CPUs. The tiny text2sql recipe joins it by `ray.address`, its two trainer ranks on one node and its
two sampler replicas on the other (`placement: disaggregated`, chosen by node labels), and trains exactly as the
same job on one node. The nodes are stopped by process group, bounded in time, whatever the tests did."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from arctic_rl_core.engines.distributed import free_port, standalone_env
from test_recipe_run import rows, train

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
JOB = ["backend.engine.ranks=2", "backend.sampler.replicas=2", "backend.placement=disaggregated",
       "pipeline.max_staleness=0", "eval.max_examples=16", "checkpoint.every=0"]
STEPS = 2


class RayNode:
    """`ray start --block` in a process group of its own: the node's daemons and workers, stopped together."""

    def __init__(self, log, *args: str):
        self.log = log
        self.proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", "--num-cpus=2",
                                      f"--dashboard-agent-listen-port={free_port()}", *args],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=standalone_env())

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM to the node's processes (Ray drains the node), SIGKILL to those left after `timeout_s`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.2)
        self.proc.wait(timeout=timeout_s)

    def alive(self) -> bool:
        self.proc.poll()  # reaps `ray start` itself, whose zombie would still count in its group
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False


NODES = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    nodes = {n["Labels"].get("role"): n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if len(nodes) == 2:
        break
    time.sleep(0.5)
print(json.dumps(nodes))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, {role: Ray node id}) of a 2-node cluster: the head `role=trainer`, a worker `role=sampler`.

    Token authentication on, as Ray starts a head by default: every node and driver that joins holds the
    cluster's token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), which this module's processes inherit."""
    work = tmp_path_factory.mktemp("ray-cluster")
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        yield from _started(work, port, address, nodes)


def _started(work, port: int, address: str, nodes: list):
    try:
        with open(work / "head.log", "w") as log:
            nodes.append(RayNode(log, "--head", f"--port={port}", "--include-dashboard=false",
                                 "--labels=role=trainer"))
        with open(work / "worker.log", "w") as log:
            nodes.append(RayNode(log, f"--address={address}", "--labels=role=sampler"))
        proc = subprocess.run([sys.executable, "-c", NODES, address], capture_output=True, text=True, timeout=180,
                              env=standalone_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(ids) == {"trainer", "sampler"}, (ids, (work / "head.log").read_text()[-2000:])
        yield address, ids
    finally:
        for node in reversed(nodes):
            node.stop()


def losses(run) -> dict:
    records = rows(run)
    sft = next(r for r in records if r.get("phase") == "after_sft")
    return {"sft": [sft["sft_loss_first"], sft["sft_loss_last"]],
            "grpo": [r["loss"] for r in records if r["kind"] == "train" and r["groups_trained"]],
            "reward": [r["reward"] for r in records if r["kind"] == "train"]}


def test_ranks_on_one_node_and_replicas_on_another_train_exactly_as_on_one_node(cluster, tmp_path_factory):
    address, ids = cluster
    one_node = tmp_path_factory.mktemp("one-node")
    train(one_node, *JOB, "backend.ray.num_cpus=4", steps=STEPS)
    two_nodes = tmp_path_factory.mktemp("two-nodes")
    train(two_nodes, *JOB, f"model.path={one_node / 'model'}", f"backend.ray.address={address}", "backend.ray.trainer_nodes.labels.role=trainer",
          "backend.ray.sampler_nodes.labels.role=sampler", steps=STEPS)

    # Where each actor ran, as the job's status reported it: ranks on the trainer node, replicas on the other.
    placement = json.load(open(two_nodes / "run" / "summary.json"))["placement"]
    assert [row["node_id"] for row in placement["trainer"]] == [ids["trainer"]] * 2, placement
    assert [row["node_id"] for row in placement["sampler"]] == [ids["sampler"]] * 2, placement
    local = json.load(open(one_node / "run" / "summary.json"))["placement"]
    assert len({row["node_id"] for row in local["trainer"] + local["sampler"]}) == 1, local

    # The same losses, step by step (fp32): the cluster changes where the work runs, not what it computes.
    here, there = losses(one_node), losses(two_nodes)
    assert len(there["grpo"]) == STEPS  # each step had groups with mixed rewards, so each trained
    for key in ("sft", "grpo", "reward"):
        assert there[key] == pytest.approx(here[key], rel=1e-5, abs=1e-7), (key, here, there)


@pytest.mark.parametrize("ray_settings, field, says", [
    ({"trainer_nodes": {"labels": {"role": "critic"}}}, "ray.trainer_nodes.labels",
     "no live node of the cluster carries {'role': 'critic'} (its nodes' labels: role=sampler, role=trainer)"),
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

    address, _ = cluster
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
    try:  # and left nothing on it: every CPU of both nodes is free
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] == 4
    finally:
        ray.shutdown()
