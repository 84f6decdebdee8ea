"""The Ray side of a distributed job: the cluster it runs on and the placement groups and actors it made.

A job joins `ray.address`, or starts a local Ray that it stops when it closes. Everything it
creates is recorded so that `close()` (also after a failed start) leaves no actors or
placement groups behind.
"""

from __future__ import annotations

import logging
import os

from arctic_rl_core.config import RaySettings
from arctic_rl_core.errors import InvalidRequest

log = logging.getLogger(__name__)


class RayJob:
    def __init__(self, settings: RaySettings):
        import ray

        self.settings = settings
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

    def accelerator(self) -> str | None:
        """"GPU" when the cluster has GPUs: each rank then takes one; None on CPU-only clusters."""
        import ray

        return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else None

    def placement_group(self, bundles: list[dict[str, float]], field: str, strategy: str = "PACK"):
        """A placement group of `bundles`, ready; a request the cluster cannot satisfy names `field`."""
        import ray
        from ray.util.placement_group import placement_group

        total: dict[str, float] = {}
        for bundle in bundles:
            for resource, amount in bundle.items():
                total[resource] = total.get(resource, 0) + amount
        have = ray.cluster_resources()
        short = {r: (amount, have.get(r, 0)) for r, amount in total.items() if have.get(r, 0) < amount}
        if short:
            detail = ", ".join(f"{amount:g} {r} needed, the cluster has {got:g}" for r, (amount, got) in short.items())
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

    def close(self) -> None:
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
