"""A Ray cluster of several nodes on this machine, started with Ray's own tools as a user's cluster is: one
`ray start --block` per node (the first the head), each with its own logical CPUs and labels (`name=<its name>`
and whatever else it is given). `tests/test_ray_cluster.py` and `arctic-rl bench sync --across-nodes` run on one.

Each node is a process group of its own (the raylet and the workers it starts), stopped by signal, bounded in
time, whatever ran on it; nothing is left behind. The nodes keep their sessions in a temporary directory of their
own, not Ray's default `/tmp/ray`, so the head's address file there (`ray_current_cluster`) never draws in another
`ray.init()` on the machine: a driver joins by the address (`ray.address`, or `RAY_ADDRESS` with `auto`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from arctic_rl_core.engines.distributed import free_port, standalone_env

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


class RayNode:
    """`ray start --block` in a process group of its own: the node's daemons and workers, stopped together."""

    def __init__(self, log_path: Path, cpus: int, *args: str):
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", f"--num-cpus={cpus}",
                                          f"--dashboard-agent-listen-port={free_port()}", *args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=standalone_env())
        # One node at a time: raylets that start together on one host can miss their registration.
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start did not start a node:\n{log_path.read_text()[-3000:]}")
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
        """`first` to the node's processes (SIGTERM: Ray drains the node, which ends its workers; SIGKILL: the
        machine is gone), SIGKILL to those left after `timeout_s`; workers the raylet left behind count still."""
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


_NODE_IDS = """
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


@dataclass
class LocalCluster:
    address: str
    """The head's GCS address (`ray.address`, `ray start --address`)."""
    dashboard: str | None
    """The head's dashboard, where `ray job submit --address` sends jobs; None where it was not started."""
    ids: dict[str, str]
    """Each node's Ray node id, by name."""
    nodes: dict[str, RayNode]


@contextlib.contextmanager
def local_cluster(work: Path, nodes: dict[str, tuple[int, dict[str, str]]], dashboard: bool = False):
    """A cluster of `nodes` (name: (logical CPUs, labels)), the first its head, with a dashboard (Ray's job server)
    if asked for.

    Token authentication on, as Ray starts a head where a token exists: every node and driver that joins asks
    for it (RAY_AUTH_MODE=token, set here for this process and what it starts, and put back after) and reads the
    machine's token (~/.ray/auth_token, made by the head if missing), the one this machine's local Rays use too."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    sessions = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths under it have a length limit
    dashboard_url = f"http://127.0.0.1:{free_port()}" if dashboard else None
    head = ["--head", f"--port={port}"] + ([f"--dashboard-port={dashboard_url.rsplit(':', 1)[1]}",
                                            "--dashboard-host=127.0.0.1"] if dashboard else ["--include-dashboard=false"])
    started: dict[str, RayNode] = {}
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        for name, (cpus, labels) in nodes.items():
            label_arg = ",".join(f"{k}={v}" for k, v in {"name": name, **labels}.items())
            started[name] = RayNode(work / f"{name}.log", cpus, *([f"--address={address}"] if started else head),
                                    f"--labels={label_arg}", f"--temp-dir={sessions}")
        proc = subprocess.run([sys.executable, "-c", _NODE_IDS, address, str(len(nodes))], capture_output=True,
                              text=True, timeout=180, env=standalone_env())
        ids = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
        if set(ids) != set(nodes):
            raise RuntimeError(f"the cluster's nodes did not all join: {ids}\n{proc.stderr[-3000:]}")
        yield LocalCluster(address, dashboard_url, ids, started)
    finally:
        for node in reversed(list(started.values())):
            node.stop()
        shutil.rmtree(sessions, ignore_errors=True)
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode

