"""One job across the nodes of a Ray cluster, started with Ray's own tools (`ray start`) as a user's cluster is:
three raylets on this machine, a head labelled `role=trainer` and two workers labelled `role=sampler`, each with
its own logical CPUs. The tiny text2sql recipe joins it by `ray.address`, its two trainer ranks on the trainer node
and its two sampler replicas on a sampler node (`placement: disaggregated`, chosen by node labels). It trains
exactly as the same job on one node, and it loses the sampler node under it and finishes every step on the other.
The nodes are stopped by process group, bounded in time, whatever the tests did."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from arctic_rl_core.engines.distributed import free_port, standalone_env
from test_recipe_run import SHORT, rows, train

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NAMES = {"trainer": "role=trainer", "sampler-a": "role=sampler", "sampler-b": "role=sampler"}
"""Each node's name (also its label `name`) and role label."""
JOB = ["backend.engine.ranks=2", "backend.sampler.replicas=2", "backend.placement=disaggregated",
       "pipeline.max_staleness=0", "eval.max_examples=16", "checkpoint.every=0"]
ON_THE_CLUSTER = ["backend.ray.trainer_nodes.labels.role=trainer", "backend.ray.sampler_nodes.labels.role=sampler"]
STEPS = 2


class RayNode:
    """`ray start --block` in a process group of its own: the node's daemons and workers, stopped together."""

    def __init__(self, log_path, *args: str):
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", "--num-cpus=2",
                                          f"--dashboard-agent-listen-port={free_port()}", *args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=standalone_env())
        # One node at a time: raylets that start together on one host can miss their registration.
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)

    def holds(self, pid: int) -> bool:
        """Whether `pid` runs on this node: started by its processes (Ray's workers are the raylet's children,
        in process groups of their own)."""
        while pid > 1:
            try:
                if os.getpgid(pid) == self.proc.pid:
                    return True
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ProcessLookupError):
                return False
        return False

    def processes(self) -> list[int]:
        return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if self.holds(pid)]

    def stop(self, timeout_s: float = 15, first: int = signal.SIGTERM) -> None:
        """`first` to the node's processes (SIGTERM: Ray drains the node, which ends its workers), SIGKILL to
        those left after `timeout_s`; workers the raylet left behind count still."""
        victims = set(self.processes())
        for sig in dict.fromkeys((first, signal.SIGKILL)):
            for pid in victims:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reaps `ray start` itself
                victims = {pid for pid in victims if os.path.exists(f"/proc/{pid}")} | set(self.processes())
                if not victims:
                    break
                time.sleep(0.2)
        self.proc.wait(timeout=timeout_s)


NODES = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    nodes = {n["Labels"].get("name"): n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if len(nodes) == int(sys.argv[2]):
        break
    time.sleep(0.5)
print(json.dumps(nodes))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, {node name: Ray node id}, {node name: RayNode}) of the 3-node cluster.

    Token authentication on, as Ray starts a head where a token exists: every node and driver that joins
    asks for it (RAY_AUTH_MODE=token, which this module's processes inherit) and reads the machine's token
    (~/.ray/auth_token, made by the head if missing), the one this machine's local Rays use too."""
    work = tmp_path_factory.mktemp("ray-cluster")
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes: dict[str, RayNode] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "token")
        try:
            for name, role in NAMES.items():
                where = [f"--address={address}"] if nodes else ["--head", f"--port={port}", "--include-dashboard=false"]
                nodes[name] = RayNode(work / f"{name}.log", *where, f"--labels={role},name={name}")
            proc = subprocess.run([sys.executable, "-c", NODES, address, str(len(NAMES))], capture_output=True,
                                  text=True, timeout=180, env=standalone_env())
            assert proc.returncode == 0, proc.stderr[-3000:]
            ids = json.loads(proc.stdout.strip().splitlines()[-1])
            assert set(ids) == set(NAMES), (ids, (work / "trainer.log").read_text()[-2000:])
            yield address, ids, nodes
        finally:
            for node in reversed(list(nodes.values())):
                node.stop()
            forget_the_cluster(port)


def forget_the_cluster(port: int) -> None:
    """What `ray stop` does beside stopping: the head's address file (the node's address and `port`) goes,
    which a later `ray.init()` without an address would otherwise try to join."""
    path = "/tmp/ray/ray_current_cluster"
    if os.path.exists(path) and open(path).read().strip().endswith(f":{port}"):
        os.remove(path)


def losses(run) -> dict:
    records = rows(run)
    sft = next(r for r in records if r.get("phase") == "after_sft")
    return {"sft": [sft["sft_loss_first"], sft["sft_loss_last"]],
            "grpo": [r["loss"] for r in records if r["kind"] == "train" and r["groups_trained"]],
            "reward": [r["reward"] for r in records if r["kind"] == "train"]}


def test_ranks_on_one_node_and_replicas_on_another_train_exactly_as_on_one_node(cluster, tmp_path_factory):
    address, ids, _ = cluster
    one_node = tmp_path_factory.mktemp("one-node")
    train(one_node, *JOB, "backend.ray.num_cpus=4", steps=STEPS)
    two_nodes = tmp_path_factory.mktemp("two-nodes")
    train(two_nodes, *JOB, f"model.path={one_node / 'model'}", f"backend.ray.address={address}", *ON_THE_CLUSTER,
          steps=STEPS)

    # Where each actor ran, as the job's status reported it: ranks on the trainer node, replicas on a sampler node.
    placement = json.load(open(two_nodes / "run" / "summary.json"))["placement"]
    assert [row["node_id"] for row in placement["trainer"]] == [ids["trainer"]] * 2, placement
    sampler_nodes = {row["node_id"] for row in placement["sampler"]}
    assert len(sampler_nodes) == 1 and sampler_nodes <= {ids["sampler-a"], ids["sampler-b"]}, placement  # PACK
    local = json.load(open(one_node / "run" / "summary.json"))["placement"]
    assert len({row["node_id"] for row in local["trainer"] + local["sampler"]}) == 1, local

    # The same losses, step by step (fp32): the cluster changes where the work runs, not what it computes.
    here, there = losses(one_node), losses(two_nodes)
    assert len(there["grpo"]) == STEPS  # each step had groups with mixed rewards, so each trained
    for key in ("sft", "grpo", "reward"):
        assert there[key] == pytest.approx(here[key], rel=1e-5, abs=1e-7), (key, here, there)


@pytest.mark.parametrize("ray_settings, field, says", [
    ({"trainer_nodes": {"labels": {"role": "critic"}}}, "ray.trainer_nodes.labels",
     "no live node of the cluster carries {'role': 'critic'} (its nodes' labels: name=sampler-a, name=sampler-b, "
     "name=trainer, role=sampler, role=trainer)"),
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

    address = cluster[0]
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
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU") != 2 * len(NAMES) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] == 2 * len(NAMES)
    finally:
        ray.shutdown()


def replica_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::SamplerReplica"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


# Last in the module: it takes a node away from the cluster the tests share.
def test_a_sampler_node_lost_mid_run_costs_no_step_and_no_sample(cluster, tmp_path_factory):
    _, ids, nodes = cluster
    run = tmp_path_factory.mktemp("node-lost")
    steps = 4
    args = [sys.executable, "-m", "arctic_rl_core.cli", "train", "text2sql_tiny", f"output_dir={run / 'run'}",
            f"model.path={run / 'model'}", *[o.format(steps=steps) for o in SHORT], *JOB,
            "backend.ray.address=auto", *ON_THE_CLUSTER, "backend.ray.start_timeout_s=300"]  # as on a node
    with open(run / "train.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=standalone_env())
        try:
            # Once the first step is in, the node holding the replicas is lost whole (its raylet and workers
            # killed, as a machine that goes away) while the next step samples.
            deadline = time.monotonic() + 600
            while not any(r["kind"] == "train" for r in (rows(run) if (run / "run" / "metrics.jsonl").exists() else [])):
                assert proc.poll() is None and time.monotonic() < deadline, (run / "train.log").read_text()[-4000:]
                time.sleep(0.5)
            lost = [name for name, node in nodes.items() if any(node.holds(pid) for pid in replica_pids())]
            assert len(lost) == 1 and lost[0].startswith("sampler"), lost
            nodes[lost[0]].stop(first=signal.SIGKILL)
            assert proc.wait(timeout=900) == 0, (run / "train.log").read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()

    train_rows = [r for r in rows(run) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    # Every step sampled its whole batch: 16 prompts x 8 samples, none dropped or lost with the node.
    assert [r["samples"] for r in train_rows] == [16 * 8] * steps
    assert all(r["groups_trained"] + r["groups_uniform"] == 16 and r["dropped"] == 0 for r in train_rows)
    # The replicas were replaced on the sampler node that survived.
    (survivor,) = {"sampler-a", "sampler-b"} - set(lost)
    sampler = json.load(open(run / "run" / "summary.json"))["placement"]["sampler"]
    assert [row["node_id"] for row in sampler] == [ids[survivor]] * 2, sampler
    assert all(row["replacements"] >= 1 for row in sampler), sampler
