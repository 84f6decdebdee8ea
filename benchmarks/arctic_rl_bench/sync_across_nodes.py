"""`arctic-rl bench sync --across-nodes`: the weight sync of a 2-rank, 2-replica job (`disaggregated`) from its
trainer ranks to sampler replicas on the ranks' own node and on another node, side by side, by each route that
crosses nodes (`shared_memory`: buckets through Ray's object store; `broadcast`: one torch.distributed group).

On a cluster of one machine (`arctic_rl_bench.local_cluster`, two raylets, each its own object store) unless
`--address` names a running one, whose nodes are picked by their `name` label (`--trainer-node`, `--other-node`). Each (route, where) is a job of its own, in a process of its own; MB/s = the model's bytes (fp32)
delivered to every replica per second of `sync_weights`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROUTES = ("shared_memory", "broadcast")
NODES = {"node-a": (4, {}), "node-b": (2, {})}
"""The local cluster: the ranks' node (the head, room for ranks and replicas), and another for the replicas."""


def worker(model_dir: str, address: str, route: str, trainer_node: str, sampler_node: str, repeats: int) -> dict:
    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_core.backend import InProcessBackend

    api = InProcessBackend({
        "model_path": model_dir, "placement": "disaggregated", "engine": {"ranks": 2},
        "sampler": {"name": "vllm", "replicas": 2, "sync": route, "kv_cache_mb": 256},
        "ray": {"address": address, "trainer_nodes": {"labels": {"name": trainer_node}},
                "sampler_nodes": {"labels": {"name": sampler_node}}}})
    try:
        described = api.describe()
        sync_s, all_s = median_seconds(api.sync_weights, repeats, warmup=1)
        return {"sync_s": sync_s, "sync_all_s": all_s,
                "trainer_nodes": sorted({row["node_id"] for row in described["trainer"]}),
                "sampler_nodes": sorted({row["node_id"] for row in described["sampler"]})}
    finally:
        api.close()


def _measure(address: str, ids: dict[str, str], trainer: str, other: str, hidden_sizes, layers: int,
             repeats: int) -> list[dict]:
    from arctic_rl_bench.measure import qwen3_of_width, run_worker

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in hidden_sizes:
            model_dir = qwen3_of_width(os.path.join(tmp, f"h{hidden}"), hidden, layers)
            nbytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
            for route in ROUTES:
                for where, replicas_on in (("one node", trainer), ("across nodes", other)):
                    r = run_worker("arctic_rl_bench.sync_across_nodes", model_dir, address, route, trainer,
                                   replicas_on, str(repeats))
                    if ids and (r["trainer_nodes"] != [ids[trainer]] or r["sampler_nodes"] != [ids[replicas_on]]):
                        raise RuntimeError(f"the job was not placed as asked: {r}")
                    rows.append({"hidden": hidden, "model_mb": nbytes / 2**20, "route": route, "replicas": where,
                                 "sync_s": r["sync_s"], "mb_per_s": nbytes / 2**20 / r["sync_s"],
                                 "raw_sync_s": r["sync_all_s"]})
    return rows


def run(repeats: int, hidden_sizes, layers: int, address: str | None = None, trainer_node: str = "node-a",
        other_node: str = "node-b") -> dict:
    """With `address`, a running cluster: ranks on `trainer_node`, replicas there and on `other_node`."""
    if address is not None:
        rows = _measure(address, {}, trainer_node, other_node, hidden_sizes, layers, repeats)
    else:
        from arctic_rl_bench.local_cluster import local_cluster

        with tempfile.TemporaryDirectory() as work, local_cluster(Path(work), NODES) as cluster:
            rows = _measure(cluster.address, cluster.ids, "node-a", "node-b", hidden_sizes, layers, repeats)
    return {"benchmark": "sync_across_nodes", "cluster": address or "local: 2 raylets on this machine",
            "dtype": "float32", "ranks": 2, "replicas": 2, "repeats": repeats, "results": rows}


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, str, str, str, str, str, int)
