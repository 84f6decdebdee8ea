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

from arctic_rl_core.config import BackendConfig, RaySettings
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
                ray.init(num_cpus=settings.num_cpus or os.cpu_count(), include_dashboard=False,
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

        def bundle(n_devices: int) -> dict[str, float]:
            return {"CPU": 1.0, **({accelerator: float(n_devices)} if accelerator else {})}

        def options(group, index: int, share: float, n_devices: int) -> dict:
            return {"num_cpus": share, "num_gpus": share * n_devices if accelerator else 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}

        if config.placement == "colocated" and ranks and replicas:
            if devices != 1:
                raise InvalidRequest("placement", "colocated sampler replicas share one device with a trainer "
                                                  "rank: tensor_parallel_size > 1 needs placement: disaggregated")
            count = max(ranks, replicas)
            group = self.placement_group([bundle(1)] * count, "engine.ranks" if ranks >= replicas else "sampler.replicas")
            layout.trainer = [options(group, i, 0.5, 1) for i in range(ranks)]
            layout.sampler = [options(group, i, 0.5, 1) for i in range(replicas)]
            layout.where = {"trainer": list(range(ranks)), "sampler": list(range(replicas))}
        else:
            if ranks:
                group = self.placement_group([bundle(1)] * ranks, "engine.ranks")
                layout.trainer = [options(group, i, 1.0, 1) for i in range(ranks)]
            if replicas:
                group = self.placement_group([bundle(devices)] * replicas, "sampler.replicas")
                layout.sampler = [options(group, i, 1.0, devices) for i in range(replicas)]
            layout.where = {"trainer": list(range(ranks)), "sampler": list(range(replicas))}
        self._layout = layout
        return layout

    def placement_group(self, bundles: list[dict[str, float]], field: str, strategy: str = "PACK"):
        """A placement group of `bundles`, ready; a request the cluster cannot satisfy names `field`."""
        import ray
        from ray.util.placement_group import placement_group

        total: dict[str, float] = {}
        for bundle in bundles:
            for resource, amount in bundle.items():
                total[resource] = total.get(resource, 0) + amount
        have, free = ray.cluster_resources(), ray.available_resources()
        short = {r: amount for r, amount in total.items() if free.get(r, 0) < amount}
        if short:
            detail = ", ".join(f"{amount:g} {r} needed, the cluster has {have.get(r, 0):g} ({free.get(r, 0):g} free)"
                               for r, amount in short.items())
            raise InvalidRequest(field, f"{len(bundles)} bundles of {bundles[0]} cannot be placed: {detail}")
        group = placement_group(bundles, strategy=strategy)
        self.placement_groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=self.settings.start_timeout_s)
        if not ready:
            raise InvalidRequest(field, f"{len(bundles)} bundles of {bundles[0]} were not placed within "
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
