"""The Ray side of a distributed job: the cluster, and where the trainer ranks and sampler replicas go.

A job joins `ray.address`, or starts a local Ray that it stops when it closes.
The trainer group and the sampler pool of one backend share one job
(`RayJob.acquire`), and with it one `Layout`: `placement: colocated` puts
rank i and replica i in one placement-group bundle (they share its devices:
half each), `disaggregated` gives each its own bundles in their own placement
groups. Everything the job creates is recorded, so that the last `release()`
(also after a failed start) leaves no actors or placement groups behind.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from arctic_rl_core.config import BackendConfig, NodeSelection, RaySettings
from arctic_rl_core.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass
class Layout:
    """Ray actor options (resources and scheduling strategy) of each trainer rank and sampler replica."""

    placement: str
    trainer: list[dict] = field(default_factory=list)
    sampler: list[dict] = field(default_factory=list)
    where: dict[str, list[int]] = field(default_factory=dict)
    """Per role, the bundle index of each actor in its placement group (reported by status)."""


def node_address() -> str:
    """The address of the node this process runs on (a rendezvous address other nodes reach)."""
    import ray

    return ray.util.get_node_ip_address()


def this_node() -> dict[str, str]:
    """Where this process runs, as status reports it: its node's address and Ray node id (nodes that share a host
    share an address)."""
    import ray

    return {"node": node_address(), "node_id": ray.get_runtime_context().get_node_id()}


def carries(node_labels: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a node with `node_labels` carries every one of `labels` (exact values, as NodeSelection takes)."""
    return all(node_labels.get(key) == value for key, value in labels.items())


class RayJob:
    _current: "RayJob | None" = None
    _guard = threading.Lock()

    @classmethod
    def acquire(cls, config: BackendConfig) -> "RayJob":
        """The job of this process, started on first use; each acquire is matched by one `release`."""
        with cls._guard:
            if cls._current is None:
                cls._current = RayJob(config.ray)
            cls._current.users += 1
            return cls._current

    def __init__(self, settings: RaySettings):
        import ray

        self.settings = settings
        self.users = 0
        self.started_ray = False
        if not ray.is_initialized():
            if settings.address is None:
                # "local": a Ray of the job's own, even where `ray start` left a cluster that ray.init() would join
                ray.init(address="local", num_cpus=settings.num_cpus or os.cpu_count(), include_dashboard=False,
                         logging_level=logging.WARNING, log_to_driver=True)
            else:
                ray.init(address=settings.address, logging_level=logging.WARNING)
            self.started_ray = True
        self.placement_groups: list = []
        self.actors: list = []
        self._layout: Layout | None = None

    def accelerator(self) -> str | None:
        """"GPU" when the cluster has GPUs: each rank then takes one; None on CPU-only clusters."""
        import ray

        return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else None

    def layout(self, config: BackendConfig) -> Layout:
        """Placement groups for every Ray actor of `config`, made once, before any actor starts."""
        if self._layout is not None:
            return self._layout
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks = config.engine.ranks if config.engine.ranks > 1 else 0
        replicas = config.sampler.replicas if config.sampler.replicas > 1 else 0
        devices = int(config.sampler.engine_args.get("tensor_parallel_size", 1))
        accelerator = self.accelerator()
        layout = Layout(config.placement)

        trainer_nodes, sampler_nodes = self.settings.trainer_nodes, self.settings.sampler_nodes

        def bundle(n_devices: int, *roles: NodeSelection) -> dict[str, float]:
            resources = {"CPU": 1.0, **({accelerator: float(n_devices)} if accelerator else {})}
            for role in roles:
                for name, amount in role.resources.items():
                    resources[name] = resources.get(name, 0.0) + amount
            return resources

        def options(group, index: int, share: float, n_devices: int) -> dict:
            return {"num_cpus": share, "num_gpus": share * n_devices if accelerator else 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}

        if config.placement == "colocated" and ranks and replicas:
            if devices != 1:
                raise InvalidRequest("placement", "colocated sampler replicas share one device with a trainer "
                                                  "rank: tensor_parallel_size > 1 needs placement: disaggregated")
            count = max(ranks, replicas)
            field = "engine.ranks" if ranks >= replicas else "sampler.replicas"
            group = self.placement_group([bundle(1, trainer_nodes, sampler_nodes)] * count, field,
                                         {**trainer_nodes.labels, **sampler_nodes.labels},
                                         "ray.trainer_nodes" if trainer_nodes.labels or trainer_nodes.resources
                                         else "ray.sampler_nodes")
            layout.trainer = [options(group, i, 0.5, 1) for i in range(ranks)]
            layout.sampler = [options(group, i, 0.5, 1) for i in range(replicas)]
        else:
            if ranks:
                group = self.placement_group([bundle(1, trainer_nodes)] * ranks, "engine.ranks",
                                             trainer_nodes.labels, "ray.trainer_nodes")
                layout.trainer = [options(group, i, 1.0, 1) for i in range(ranks)]
            if replicas:
                group = self.placement_group([bundle(devices, sampler_nodes)] * replicas, "sampler.replicas",
                                             sampler_nodes.labels, "ray.sampler_nodes")
                layout.sampler = [options(group, i, 1.0, devices) for i in range(replicas)]
        layout.where = {"trainer": list(range(ranks)), "sampler": list(range(replicas))}
        self._layout = layout
        return layout

    def placement_group(self, bundles: list[dict[str, float]], field: str, labels: dict[str, str] | None = None,
                        nodes_field: str = ""):
        """A placement group of `bundles`, ready, each on a node carrying `labels`. A request the cluster cannot
        satisfy is refused naming the setting at fault: `nodes_field` (the role's ray.*_nodes) for its labels or
        custom resources, else `field` (the count of actors); at once where the cluster's nodes cannot hold it,
        else after ray.start_timeout_s."""
        import ray
        from ray.util.placement_group import placement_group

        total: dict[str, float] = {}
        for bundle in bundles:
            for resource, amount in bundle.items():
                total[resource] = total.get(resource, 0) + amount
        have, free = ray.cluster_resources(), ray.available_resources()
        holder = "the cluster has"
        if labels:
            nodes = [n for n in ray.nodes() if n["Alive"] and carries(n.get("Labels", {}), labels)]
            if not nodes:
                seen = sorted({f"{k}={v}" for n in ray.nodes() if n["Alive"] for k, v in n.get("Labels", {}).items()
                               if not k.startswith("ray.io/")})
                raise InvalidRequest(f"{nodes_field}.labels", f"no live node of the cluster carries {labels} "
                                                   f"(its nodes' labels: {', '.join(seen) or 'none'})")
            have = {}
            for node in nodes:
                for resource, amount in node["Resources"].items():
                    have[resource] = have.get(resource, 0) + amount
            free = {r: min(amount, free.get(r, 0)) for r, amount in have.items()}
            holder = f"the {len(nodes)} node(s) carrying {labels} have"
        short = {r: amount for r, amount in total.items() if free.get(r, 0) < amount}
        if short:
            detail = ", ".join(f"{amount:g} {r} needed, {holder} {have.get(r, 0):g} ({free.get(r, 0):g} free)"
                               for r, amount in short.items())
            custom = any(r not in ("CPU", "GPU") for r in short)
            raise InvalidRequest(f"{nodes_field}.resources" if custom else field,
                                 f"{len(bundles)} bundles of {bundles[0]} cannot be placed: {detail}")
        group = placement_group(bundles, strategy="PACK",
                                bundle_label_selector=[dict(labels)] * len(bundles) if labels else None)
        self.placement_groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=self.settings.start_timeout_s)
        if not ready:
            raise InvalidRequest(field, f"{len(bundles)} bundles of {bundles[0]}"
                                        f"{f' on nodes carrying {labels}' if labels else ''} were not placed within "
                                        f"ray.start_timeout_s={self.settings.start_timeout_s:g} s (resources in use?)")
        return group

    def actor(self, cls, *args, **options):
        """An actor of `cls` (a plain class) with Ray `options`, recorded for `close()`."""
        import ray

        handle = ray.remote(cls).options(**options).remote(*args)
        self.actors.append(handle)
        return handle

    def forget(self, handle) -> None:
        """`handle` died: kill what is left of it and stop recording it."""
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
        if handle in self.actors:
            self.actors.remove(handle)

    def release(self) -> None:
        """One user is done; the last one closes the job."""
        with RayJob._guard:
            self.users -= 1
            if self.users > 0:
                return
            if RayJob._current is self:
                RayJob._current = None
        self._close()

    def _close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for handle in self.actors:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead
                pass
        for group in self.placement_groups:
            try:
                ray.util.remove_placement_group(group)
            except Exception:
                pass
        self.actors.clear()
        self.placement_groups.clear()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
