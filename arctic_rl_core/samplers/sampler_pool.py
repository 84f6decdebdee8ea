"""`sampler.replicas: M`: M samplers as Ray actors, behind the one `Sampler` contract.

- `generate` deals prompts to replicas with group affinity: identical prompts
  (a GRPO group sent as n=1 copies) and a prompt's n samples go to one replica,
  so its prefix cache computes the prompt once. Groups go, largest first, to the
  replica with the fewest queued tokens (prompt once plus every sample's
  max_tokens), counting what concurrent calls already queued there.
  `score` (`log_probs(source="sampler")`) is dealt the same way.
- `load_weights` streams buckets of the trainer's weights through Ray's object
  store (shared memory between processes of one machine, Ray's transfer between
  machines) to every replica at once; each replica loads them as they arrive and
  reports its own weight version. The last sync's buckets stay in the object
  store so that a replacement replica can be brought to the current version.
- A replica that dies is replaced in its placement bundle, loaded with the
  current weights, and the prompts it held are dealt again; what a dead replica
  produced is never returned, so no request is lost or answered twice.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Iterable

import torch

from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.samplers.base import Sampler
from arctic_rl_core.types import Completion, SamplingParams

log = logging.getLogger("arctic_rl.sampler_pool")

_MAX_REPLACEMENTS_PER_CALL = 4
"""A call that loses more replicas than this fails instead of replacing them forever."""


class SamplerReplicaFailed(ArcticRLError):
    """Sampler replicas kept dying during one call; the call was not answered."""


def _node() -> str:
    import ray

    return ray.util.get_node_ip_address()


class SamplerReplica:
    """One sampler (any registered `sampler.name`) in its own Ray actor."""

    def __init__(self, config: dict, index: int):
        from arctic_rl_core.plugins.manager import load_plugins

        cfg = BackendConfig.model_validate(config)
        cfg.sampler.replicas, cfg.sampler.placement = 1, "in_process"
        self.index = index
        self.sampler = load_plugins().sampler_factory(cfg.sampler.name)(cfg)
        self.weight_version = 0
        self._busy = threading.Lock()  # one engine call at a time: vLLM's LLM is not thread-safe
        self._incoming: queue.Queue | None = None
        self._loader: threading.Thread | None = None
        self._loaded: tuple[int | None, BaseException | None] = (None, None)

    def facts(self) -> dict:
        return {"node": _node(), "pid": os.getpid(), "max_context": self.sampler.max_context,
                "sync_route": self.sampler.sync_route}

    def generate(self, prompts, sampling: SamplingParams) -> list[Completion]:
        with self._busy:
            return self.sampler.generate(prompts, sampling, self.weight_version)

    def score(self, sequences):
        with self._busy:
            return self.sampler.score(sequences)

    def sleep(self) -> None:
        with self._busy:
            self.sampler.sleep()

    def wake_up(self) -> None:
        with self._busy:
            self.sampler.wake_up()

    # A sync is begin_load, put_bucket per bucket, end_load: the sampler takes one iterator over all
    # weights, which a thread here feeds from the buckets as they arrive.
    def begin_load(self, version: int) -> None:
        self._incoming, self._loading = queue.Queue(maxsize=1), version
        self._loaded = (None, None)

        def stream():
            while (bucket := self._incoming.get()) is not None:
                yield from bucket

        def load():
            try:
                with self._busy:
                    self._loaded = (self.sampler.load_weights(stream(), self._loading), None)
            except BaseException as err:  # reported by end_load
                self._loaded = (None, err)
                while self._incoming.get() is not None:  # let the sender finish
                    pass

        self._loader = threading.Thread(target=load, name="arctic-rl-replica-load", daemon=True)
        self._loader.start()

    def put_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._incoming.put(bucket)  # waits while the loader holds the previous bucket

    def end_load(self) -> int:
        self._incoming.put(None)
        self._loader.join()
        count, err = self._loaded
        if err is not None:
            raise err
        self.weight_version = self._loading
        return count


class _Slot:
    """A replica's place in the pool: its actor, its placement bundle's index, and what is queued on it."""

    def __init__(self, index: int):
        self.index = index
        self.actor = None
        self.facts: dict = {}
        self.weight_version = 0
        self.queued_tokens = 0
        self.healthy = False
        self.replacements = 0
        self.error: str | None = None


Unit = tuple[int, list[int]]
"""(cost in tokens, indexes into the call's prompts or sequences): dealt to one replica whole."""


class SamplerPool(Sampler):
    concurrent_generate = True  # calls may overlap: each replica queues its own work

    def __init__(self, config: BackendConfig):
        from arctic_rl_core.ray_job import RayJob

        sc = config.sampler
        self.config = config
        self.bucket_bytes = int(sc.bucket_mb * 2**20)
        self.job = RayJob.acquire(config)
        self._slots = [_Slot(i) for i in range(sc.replicas)]
        self._changed = threading.Condition()
        """Guards the slots' counters and health; notified when a replica becomes healthy."""
        self._sync_lock = threading.Lock()
        """Held by a sync and by a replacement's load, so a replacement never ends a version behind."""
        self._last_sync: tuple[int, list] = (0, [])
        """(version, object-store refs of its buckets): what a replacement replica loads."""
        self.last_deal: dict[int, list[int]] = {}
        """Which prompts (or sequences) of the last call each replica answered."""
        self.redealt = 0
        """Shares dealt again because their replica died during a call."""
        try:
            self._layout = self.job.layout(config)
            for slot in self._slots:
                self._start(slot)
            for slot in self._slots:
                self._started(slot)
        except BaseException:
            self.job.release()
            raise
        first = self._slots[0].facts
        self.max_context = first["max_context"]
        self.sync_route = f"object_store -> {first['sync_route']}"

    # -- replicas --------------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        slot.actor = self.job.actor(SamplerReplica, self.config.model_dump(mode="json"), slot.index,
                                    max_concurrency=4, **self._layout.sampler[slot.index])

    def _started(self, slot: _Slot) -> None:
        import ray

        slot.facts = ray.get(slot.actor.facts.remote(), timeout=self.config.ray.start_timeout_s)
        with self._changed:
            slot.healthy, slot.error = True, None
            self._changed.notify_all()

    def _lost(self, slot: _Slot, actor, reason: str) -> None:
        """`actor` (the slot's replica when the failure was seen) died: replace it in the background,
        once, however many calls saw it die."""
        with self._changed:
            if slot.actor is not actor or not slot.healthy:
                return
            slot.healthy, slot.error = False, reason
        log.warning("sampler replica %d died (%s): replacing it", slot.index, reason)
        threading.Thread(target=self._replace, args=(slot, actor), name=f"arctic-rl-replace-{slot.index}",
                         daemon=True).start()

    def _replace(self, slot: _Slot, dead) -> None:
        import ray

        self.job.forget(dead)
        try:
            self._start(slot)
            slot.facts = ray.get(slot.actor.facts.remote(), timeout=self.config.ray.start_timeout_s)
            with self._sync_lock:
                version, refs = self._last_sync
                if refs:
                    self._send([slot], refs, version)
                slot.weight_version = version
        except Exception as err:
            log.error("sampler replica %d could not be replaced: %s", slot.index, err)
            slot.error = f"replacement failed: {err}"
            return
        slot.replacements += 1
        with self._changed:
            slot.healthy, slot.error = True, None
            self._changed.notify_all()

    def wait_healthy(self, timeout: float) -> bool:
        """Whether every replica is healthy within `timeout` seconds (replacements take a replica's start-up)."""
        with self._changed:
            return self._changed.wait_for(lambda: all(s.healthy for s in self._slots), timeout)

    # -- dealing work ----------------------------------------------------------------------------

    def _deal(self, units: list[Unit]) -> dict[int, list[Unit]]:
        """Units onto healthy replicas, largest first onto the fewest queued tokens; waits (up to the start
        timeout) for a replacement when none is healthy."""
        with self._changed:
            if not self._changed.wait_for(lambda: any(s.healthy for s in self._slots),
                                          self.config.ray.start_timeout_s):
                raise SamplerReplicaFailed("no sampler replica is alive: "
                                           + "; ".join(f"{s.index}: {s.error}" for s in self._slots))
            live = [s for s in self._slots if s.healthy]
            dealt: dict[int, list[Unit]] = {}
            for unit in sorted(units, key=lambda u: -u[0]):
                slot = min(live, key=lambda s: (s.queued_tokens, s.index))
                slot.queued_tokens += unit[0]
                dealt.setdefault(slot.index, []).append(unit)
            return dealt

    def _run(self, units: list[Unit], call) -> list[tuple[list[int], object]]:
        """`call(actor, indexes)` on each replica's share, gathered as (indexes, result). The share of a replica
        that dies is dealt again to the live ones at once; nothing a dead replica produced is returned."""
        deal: dict[int, list[int]] = {}
        import ray
        from ray.exceptions import RayActorError

        answered, lost = [], 0
        outstanding: dict = {}

        def submit(pending: list[Unit]) -> None:
            for index, share in self._deal(pending).items():
                slot = self._slots[index]
                indexes = [i for _, ix in share for i in ix]
                outstanding[call(slot.actor, indexes)] = (slot, slot.actor, share, indexes)

        submit(units)
        while outstanding:
            [ref], _ = ray.wait(list(outstanding), num_returns=1)
            slot, actor, share, indexes = outstanding.pop(ref)
            with self._changed:
                slot.queued_tokens -= sum(cost for cost, _ in share)
            try:
                answered.append((indexes, ray.get(ref)))
                deal.setdefault(slot.index, []).extend(indexes)
            except RayActorError as err:
                lost += 1
                if lost > _MAX_REPLACEMENTS_PER_CALL:
                    raise SamplerReplicaFailed(f"{lost} sampler replicas died during one call; it was not "
                                               f"answered: {err}") from None
                self._lost(slot, actor, type(err).__name__)
                self.redealt += 1
                submit(share)
        self.last_deal = {index: sorted(ix) for index, ix in sorted(deal.items())}
        return answered

    @staticmethod
    def _by_prompt(prompts: list, cost) -> list[Unit]:
        """Identical prompts form one unit: one replica's prefix cache computes the prompt once."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(tuple(prompt), []).append(i)
        return [(cost(ix), ix) for ix in groups.values()]

    # -- Sampler ---------------------------------------------------------------------------------

    def generate(self, prompts, sampling: SamplingParams, weight_version: int) -> list[Completion]:
        units = self._by_prompt(prompts, lambda ix: len(prompts[ix[0]]) + len(ix) * sampling.n * sampling.max_tokens)
        out: list[Completion] = []
        for indexes, completions in self._run(units, lambda a, ix: a.generate.remote([prompts[i] for i in ix], sampling)):
            out.extend(c.model_copy(update={"prompt_index": indexes[c.prompt_index]}) for c in completions)
        out.sort(key=lambda c: c.prompt_index)  # stable: a prompt's n samples keep their order
        return out

    def score(self, sequences):
        units = self._by_prompt([p for p, _ in sequences],
                                lambda ix: len(sequences[ix[0]][0]) + sum(len(sequences[i][1]) for i in ix))
        scores: list = [None] * len(sequences)
        for indexes, part in self._run(units, lambda a, ix: a.score.remote([sequences[i] for i in ix])):
            for i, s in zip(indexes, part):
                scores[i] = s
        return scores

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Every healthy replica loads the same buckets. A replica that refuses them fails the sync (the
        others hold the new weights; the next sync brings every replica to one version again); one that dies
        is replaced at this version."""
        with self._sync_lock:
            refs = list(self._buckets(weights))
            loaded = self._send([s for s in self._slots if s.healthy], refs, version)
            self._last_sync = (version, refs)  # the previous sync's buckets are released here
            for slot, _ in loaded:
                slot.weight_version = version
            return loaded[0][1]

    def _buckets(self, weights) -> Iterable:
        """Object-store refs of the weights in buckets: the trainer group's own refs where it has them
        (rank 0's buckets go to the replicas without passing through this process)."""
        import ray

        remote = getattr(weights, "bucket_refs", None)
        if remote is not None:
            yield from remote()
            return
        bucket, size = [], 0
        for name, tensor in weights:
            bucket.append((name, tensor.detach().cpu().clone()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield ray.put(bucket)
                bucket, size = [], 0
        if bucket:
            yield ray.put(bucket)

    def _send(self, slots: list[_Slot], refs: list, version: int) -> list[tuple[_Slot, int]]:
        """The buckets `refs` to every slot's replica; (slot, tensors loaded) for each that survived."""
        slots = self._each(slots, "begin_load", version)
        for ref in refs:  # bucket by bucket: each replica holds at most two at a time
            slots = self._each(slots, "put_bucket", ref)
        loaded = self._each_result(slots, "end_load")
        if not loaded:
            raise SamplerReplicaFailed("every sampler replica died during sync_weights")
        return loaded

    def _each_result(self, slots: list[_Slot], method: str, *args) -> list[tuple[_Slot, object]]:
        """`method` on every slot's replica; a replica that died is replaced and left out."""
        import ray
        from ray.exceptions import RayActorError

        calls = [(slot, slot.actor, getattr(slot.actor, method).remote(*args)) for slot in slots]
        done = []
        for slot, actor, ref in calls:
            try:
                done.append((slot, ray.get(ref)))
            except RayActorError as err:
                self._lost(slot, actor, type(err).__name__)
        return done

    def _each(self, slots: list[_Slot], method: str, *args) -> list[_Slot]:
        return [slot for slot, _ in self._each_result(slots, method, *args)]

    def sleep(self) -> None:
        import ray

        ray.get([s.actor.sleep.remote() for s in self._slots if s.healthy])

    def wake_up(self) -> None:
        import ray

        ray.get([s.actor.wake_up.remote() for s in self._slots if s.healthy])

    # -- status ----------------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        """Every replica: where it runs, whether it answers, its weight version and queued tokens. A replica
        found dead here is replaced as if a call had seen it die."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        rows = []
        for slot in self._slots:
            actor, healthy = slot.actor, slot.healthy
            if healthy:
                try:
                    ray.get(actor.facts.remote(), timeout=10)
                except RayActorError as err:
                    self._lost(slot, actor, type(err).__name__)
                    healthy = False
                except GetTimeoutError:
                    healthy = False
            rows.append({"replica": slot.index, "node": slot.facts.get("node"), "pid": slot.facts.get("pid"),
                         "bundle": self._layout.where["sampler"][slot.index],
                         "healthy": healthy, "weight_version": slot.weight_version,
                         "queued_tokens": slot.queued_tokens, "replacements": slot.replacements,
                         **({"error": slot.error} if slot.error else {})})
        return rows

    def close(self) -> None:
        self.job.release()
