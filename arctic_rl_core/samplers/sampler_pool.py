"""`sampler.replicas: M`: M samplers as Ray actors (`replica.SamplerReplica`), behind the one `Sampler` contract.

- `generate` deals prompts to replicas with group affinity: identical prompts
  (a GRPO group sent as n=1 copies) and a prompt's n samples go to one replica,
  so its prefix cache computes the prompt once. Groups go, largest first, to the
  replica with the fewest queued tokens (prompt once plus every sample's
  max_tokens, counting what concurrent calls already queued there) less the
  prompt's prefix it likely caches (`prefix_affinity`): a multi-turn episode's
  next turn returns to the replica that holds its history unless another is idler
  by more than that prefill. `score` (`log_probs(source="sampler")`) is dealt the
  same way. Replicas whose sampler batches continuously (vLLM) take concurrent
  calls at once, so the serving routes send each request as its own call.
- `load_weights` brings every replica to the new version, by `sampler.sync`:
  `shared_memory`: buckets through Ray's object store (shared memory between
  the processes of a machine, Ray's transfer between machines), the trainer
  group's rank 0 putting them there itself; `broadcast`: a collective group of
  the source (trainer rank 0, or the driver) and the replicas (gloo on CPU,
  NCCL on GPUs).
- A replica that dies is replaced in its placement bundle and brought to the
  current version (the last sync's buckets, kept in the object store; on the
  broadcast route a live peer's weights), and the prompts it held are dealt
  again; what a dead replica produced is never returned, so no request is lost
  or answered twice. A sync that fails part-way leaves the replicas it reached
  `stale`: they take no work until the next sync completes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, Iterable

import torch

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.samplers.base import Sampler
from arctic_rl_core.samplers.engine_metrics import relabelled
from arctic_rl_core.ray_job import node_address
from arctic_rl_core.samplers.prefix_affinity import PrefixIndex, block_hashes
from arctic_rl_core.samplers.stored_buckets import stored
from arctic_rl_core.samplers.replica import SamplerReplica
from arctic_rl_core.samplers.bucket_protocol import BucketSender, join_group
from arctic_rl_core.types import Completion, SamplingParams

log = logging.getLogger("arctic_rl.sampler_pool")

_MAX_REPLACEMENTS_PER_CALL = 4
"""A call that loses more replicas than this fails instead of replacing them forever."""

_PREFIX_BLOCKS = 1 << 16
"""Prefix blocks remembered per replica (a million tokens: more than a replica's KV cache holds, so at worst a
match is stale and costs balance, never correctness)."""

_CALLS_PER_REPLICA = 64
"""Calls a replica's actor runs at once (a continuously batched sampler joins them into one running batch)."""


class SamplerReplicaFailed(ArcticRLError):
    """Sampler replicas died or failed; the call (or sync) was not completed."""


class _ReplacementDied(Exception):
    """A replacement replica died while it loaded the pool's weights (tried again, as one that died starting)."""


class _Slot:
    """A replica's place in the pool: its actor, its state, and what is queued on it.

    States: `starting`; `ready` (takes work); `stale` (alive, but a sync failed part-way: waits for the
    next); `replacing` (the actor died; a new one is starting); `failed` (could not be replaced)."""

    def __init__(self, index: int):
        self.index = index
        self.actor = None
        self.facts: dict = {}
        self.state = "starting"
        self.weight_version = 0
        self.queued_tokens = 0
        self.prefixes = PrefixIndex(_PREFIX_BLOCKS)
        self.replacements = 0
        self.incarnation = 0
        """Counts the actors started in this slot: a sync group is formed again when its members change."""
        self.error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.state == "ready"


Unit = tuple[int, list[int], list[int]]
"""(cost in tokens, indexes into the call's prompts or sequences, the prompt's block hashes): dealt to one
replica whole."""


class SamplerPool(Sampler):
    concurrent_generate = True  # calls may overlap: each replica queues its own work

    def __init__(self, config: BackendConfig):
        from arctic_rl_core.ray_job import RayJob

        sc = config.sampler
        self.config = config
        self.route = "broadcast" if sc.sync == "broadcast" else "object_store"
        self.bucket_bytes = int(sc.bucket_mb * 2**20)
        self.job = RayJob.acquire(config)
        self._slots = [_Slot(i) for i in range(sc.replicas)]
        self._changed = threading.Condition()
        """Guards the slots' states and counters; notified when a slot's state changes."""
        self._sync_lock = threading.Lock()
        """Held by a sync and by a replacement's load, so a replacement never ends a version behind."""
        self._version = 0
        self._last_sync: list = []
        """Object-store route: refs of the last sync's buckets, what a replacement replica loads."""
        self._group = None
        """Broadcast route: (members, this process's group or None where trainer rank 0 is the source)."""
        self.last_deal: dict[int, list[int]] = {}
        """Which prompts (or sequences) of the last call each replica answered."""
        self.redealt = 0
        """Shares dealt again because their replica died during a call."""
        self.adapters = config.sampler.adapters
        self._adapters: dict[str, str] = {}
        """The LoRA adapters every replica serves: name -> folder (a replacement loads them too)."""
        self._adapters_lock = threading.Lock()
        try:
            self._layout = self.job.layout(config)
            self.cuda = self.job.accelerator() == "GPU"
            for slot in self._slots:
                self._start(slot)
            for slot in self._slots:
                self._started(slot)
        except BaseException:
            self.job.release()
            raise
        first = self._slots[0].facts
        self.max_context = first["max_context"]
        self.sync_route = f"{self.route} -> {first['sync_route']}"

    # -- replicas --------------------------------------------------------------------------------

    def _set(self, slot: _Slot, state: str, error: str | None = None) -> None:
        with self._changed:
            slot.state, slot.error = state, error
            self._changed.notify_all()

    def _start(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.prefixes.clear()
        slot.actor = self.job.actor(SamplerReplica, self.config.model_dump(mode="json"), slot.index,
                                    max_concurrency=_CALLS_PER_REPLICA, **self._layout.sampler[slot.index])

    def _started(self, slot: _Slot) -> None:
        import ray

        slot.facts = ray.get(slot.actor.facts.remote(), timeout=self.config.ray.start_timeout_s)
        self._set(slot, "ready")

    def _lost(self, slot: _Slot, actor, reason: str) -> None:
        """`actor` (the slot's replica when the failure was seen) died: replace it in the background,
        once, however many calls saw it die."""
        with self._changed:
            if slot.actor is not actor or slot.state in ("replacing", "failed"):
                return
            slot.state, slot.error = "replacing", reason
        log.warning("sampler replica %d died (%s): replacing it", slot.index, reason)
        threading.Thread(target=self._replace, args=(slot, actor), name=f"arctic-rl-replace-{slot.index}",
                         daemon=True).start()

    def _replace(self, slot: _Slot, dead) -> None:
        """A new replica in the dead one's bundle, at the pool's version. A replacement that dies starting is
        tried again until ray.start_timeout_s: one placed on a node that died before Ray declared it dead (its
        health checks take a while), whose bundle Ray then moves to a live node."""
        import ray
        from ray.exceptions import RayActorError

        self.job.forget(dead)
        deadline = time.monotonic() + self.config.ray.start_timeout_s
        while True:
            try:
                self._start(slot)
                slot.facts = ray.get(slot.actor.facts.remote(), timeout=max(1.0, deadline - time.monotonic()))
                with self._sync_lock:
                    state, error = self._catch_up(slot)
                with self._adapters_lock:  # the adapters the pool serves, on the replacement too
                    ray.get([slot.actor.add_adapter.remote(name, path) for name, path in self._adapters.items()])
                break
            except (RayActorError, _ReplacementDied) as err:
                self.job.forget(slot.actor)
                if time.monotonic() < deadline:
                    log.warning("sampler replica %d's replacement died starting (%s): trying again", slot.index,
                                type(err).__name__)
                    time.sleep(1.0)
                    continue
                failure = err
            except Exception as err:
                failure = err
            log.error("sampler replica %d could not be replaced: %s", slot.index, failure)
            self._set(slot, "failed", f"replacement failed: {failure}")
            return
        slot.replacements += 1
        self._set(slot, state, error)

    def _catch_up(self, slot: _Slot) -> tuple[str, str | None]:
        """Bring a new replica to the pool's version: the last sync's buckets, or (broadcast route) a ready
        peer's weights; where neither can be had it waits, stale, for the next sync."""
        import ray

        if self._version == 0:
            return "ready", None  # the checkpoint's weights, which it loaded
        refs = self._last_sync
        if self.route == "broadcast":
            self._group = None  # the group had the dead replica: formed again at the next sync
            peer = next((s for s in self._slots if s.healthy and s.weight_version == self._version), None)
            held = ray.get(peer.actor.export_weights.remote()) if peer is not None else None
            refs = [ray.put(stored(held))] if held is not None else []
        if not refs:
            return "stale", "waits for the next sync_weights (no peer could give the current weights)"
        if not self._send_object_store([slot], refs, self._version):
            raise _ReplacementDied("the replacement died while it loaded the current weights")
        slot.weight_version = self._version
        return "ready", None

    def wait_healthy(self, timeout: float) -> bool:
        """Whether every replica is ready within `timeout` seconds (a replacement takes a replica's start-up)."""
        with self._changed:
            return self._changed.wait_for(lambda: all(s.healthy for s in self._slots), timeout)

    # -- dealing work ----------------------------------------------------------------------------

    def _deal(self, units: list[Unit]) -> dict[int, list[Unit]]:
        """Units onto ready replicas, largest first onto the fewest queued tokens less the prompt's likely cached
        prefix; waits (up to the start timeout) for a replacement when none is ready."""
        with self._changed:
            if not self._changed.wait_for(lambda: any(s.healthy for s in self._slots),
                                          self.config.ray.start_timeout_s):
                raise SamplerReplicaFailed("no sampler replica is ready: "
                                           + "; ".join(f"{s.index}: {s.state} ({s.error})" for s in self._slots))
            live = [s for s in self._slots if s.healthy]
            dealt: dict[int, list[Unit]] = {}
            for unit in sorted(units, key=lambda u: -u[0]):
                cost, _, hashes = unit
                slot = min(live, key=lambda s: (s.queued_tokens - s.prefixes.cached_tokens(hashes), s.index))
                slot.queued_tokens += cost
                slot.prefixes.add(hashes)
                dealt.setdefault(slot.index, []).append(unit)
            return dealt

    def _run(self, units: list[Unit], call, on_item=None) -> list[tuple[list[int], object]]:
        """`call(actor, indexes)` on each replica's share, gathered as (indexes, result). The share of a replica
        that dies is dealt again to the live ones at once; nothing a dead replica produced is returned.

        With `on_item(indexes, item)`, `call` returns a Ray streaming generator: each item before the last goes to
        `on_item` as it comes, the last is the share's result. A share whose replica dies after `on_item` heard
        of it is not dealt again (what was heard cannot be taken back): the call fails."""
        import ray
        from ray.exceptions import RayActorError

        deal: dict[int, list[int]] = {}
        answered, lost = [], 0
        outstanding: dict = {}

        def submit(pending: list[Unit]) -> None:
            for index, share in self._deal(pending).items():
                slot = self._slots[index]
                indexes = [i for _, ix, _ in share for i in ix]
                outstanding[call(slot.actor, indexes)] = (slot, slot.actor, share, indexes, False)

        submit(units)
        try:
            while outstanding:
                [ready], _ = ray.wait(list(outstanding), num_returns=1)
                slot, actor, share, indexes, heard = outstanding.pop(ready)
                try:
                    if on_item is None:
                        result = ray.get(ready)
                    else:
                        kind, result = ray.get(next(ready))
                        if kind != "done":
                            outstanding[ready] = (slot, actor, share, indexes, True)
                            on_item(indexes, result)
                            continue
                except RayActorError as err:
                    with self._changed:
                        slot.queued_tokens -= sum(cost for cost, _, _ in share)
                    lost += 1
                    self._lost(slot, actor, type(err).__name__)
                    if heard:
                        raise SamplerReplicaFailed(f"sampler replica {slot.index} died after streaming tokens of this "
                                                   f"call, which cannot be taken back; it was not answered: {err}") \
                            from None
                    if lost > _MAX_REPLACEMENTS_PER_CALL:
                        raise SamplerReplicaFailed(f"{lost} sampler replicas died during one call; it was not "
                                                   f"answered: {err}") from None
                    self.redealt += 1
                    submit(share)
                    continue
                with self._changed:
                    slot.queued_tokens -= sum(cost for cost, _, _ in share)
                answered.append((indexes, result))
                deal.setdefault(slot.index, []).extend(indexes)
        finally:  # a call that fails leaves shares running: they no longer count on their replicas
            with self._changed:
                for slot, _, share, _, _ in outstanding.values():
                    slot.queued_tokens -= sum(cost for cost, _, _ in share)
        self.last_deal = {index: sorted(ix) for index, ix in sorted(deal.items())}
        return answered

    @staticmethod
    def _by_prompt(prompts: list, cost) -> list[Unit]:
        """Identical prompts form one unit: one replica's prefix cache computes the prompt once."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(tuple(prompt), []).append(i)
        return [(cost(ix), ix, block_hashes(prompts[ix[0]])) for ix in groups.values()]

    # -- Sampler ---------------------------------------------------------------------------------

    def generate(self, prompts, sampling: SamplingParams, weight_version: int,
                 on_tokens: Callable[..., None] | None = None,
                 cancel: Cancellation | None = None) -> list[Completion]:
        """`on_tokens(prompt index, sample index, token ids, log-probs, top log-probs, ranks)`: as the vLLM
        sampler's, where every replica streams (each replica's tokens reach this process as its engine samples them). `cancel`: once cancelled, every live
        replica is told to end its share of this call."""
        units = self._by_prompt(prompts, lambda ix: len(prompts[ix[0]]) + len(ix) * sampling.n * sampling.max_tokens)
        call_id = None
        if cancel is not None:
            call_id = uuid.uuid4().hex
            cancel.on_cancel(lambda: [slot.actor.cancel.remote(call_id) for slot in self._live()])
        if on_tokens is None:
            run = self._run(units, lambda a, ix: a.generate.remote([prompts[i] for i in ix], sampling, None, call_id))
        else:
            def heard(indexes: list[int], tokens: list[tuple]) -> None:
                for prompt, *rest in tokens:
                    on_tokens(indexes[prompt], *rest)

            run = self._run(units, lambda a, ix: a.generate_stream.options(num_returns="streaming").remote(
                [prompts[i] for i in ix], sampling, call_id), heard)
        out: list[Completion] = []
        for indexes, completions in run:
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
        """Every live replica (ready or stale) loads the new weights. A sync that fails part-way leaves the
        replicas it reached stale and raises; one that completes makes them ready at `version`. A replica that
        dies during it is replaced and loads `version`: on the object-store route even when every replica died
        (a sampler node lost), since the buckets stay in the object store; the tensors loaded are then 0."""
        with self._sync_lock:
            slots = self._live()
            if not slots:
                raise SamplerReplicaFailed("no live sampler replica to sync: "
                                           + "; ".join(f"{s.index}: {s.state}" for s in self._slots))
            try:
                if self.route == "broadcast":
                    loaded = self._send_broadcast(slots, weights, version)
                else:
                    refs = list(self._buckets(weights))
                    loaded = self._send_object_store(slots, refs, version)
                    self._last_sync = refs  # the previous sync's buckets are released here
            except Exception as err:
                self._group = None
                for slot in self._alive(slots):
                    self._set(slot, "stale", f"a sync_weights failed part-way: {err}")
                raise SamplerReplicaFailed(f"sync_weights did not reach every replica ({err}); the replicas it "
                                           "reached wait for the next sync_weights") from err
            if not loaded:
                log.warning("every sampler replica died during sync_weights: their replacements load version %d",
                            version)
            self._version = version
            for slot in self._slots:  # every reached replica emptied its prefix cache; the others were replaced
                slot.prefixes.clear()
            for slot, _ in loaded:
                slot.weight_version = version
                self._set(slot, "ready")
            return loaded[0][1] if loaded else 0

    # -- the object-store route ------------------------------------------------------------------

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
                yield ray.put(stored(bucket))
                bucket, size = [], 0
        if bucket:
            yield ray.put(stored(bucket))

    def _send_object_store(self, slots: list[_Slot], refs: list, version: int) -> list[tuple[_Slot, int]]:
        """The buckets `refs` to every slot's replica; (slot, tensors loaded) for each that survived."""
        slots = self._each(slots, "begin_load", version)
        for ref in refs:  # bucket by bucket: each replica holds at most two at a time
            slots = self._each(slots, "put_bucket", ref)
        return self._each_result(slots, "end_load")

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

    def _alive(self, slots: list[_Slot]) -> list[_Slot]:
        """The slots whose replica answers; the others are replaced."""
        return self._each(slots, "facts")

    # -- the broadcast route ---------------------------------------------------------------------

    def _send_broadcast(self, slots: list[_Slot], weights, version: int) -> list[tuple[_Slot, int]]:
        """Rank 0 of the group (trainer rank 0, or this process) broadcasts buckets; every replica loads them
        as they arrive. The group is formed again whenever its members changed."""
        import ray

        trainer = getattr(weights, "broadcast", None)
        members = tuple((s.index, s.incarnation) for s in slots)
        if self._group is None or self._group[0] != members:
            self._group = (members, self._form_group(slots, weights))
        receives = [s.actor.receive_broadcast.remote(version) for s in slots]
        if trainer is not None:
            trainer(self.bucket_bytes)
        else:
            sender = BucketSender(self._group[1], self.bucket_bytes, owner=self)
            try:
                for name, tensor in weights:
                    sender.add(name, tensor)
            finally:
                sender.close()  # the replicas stop at the end marker even if the trainer side failed
        return list(zip(slots, ray.get(receives, timeout=self.config.ray.start_timeout_s)))

    def _form_group(self, slots: list[_Slot], weights):
        import ray

        from arctic_rl_core.engines.distributed import free_port

        world, timeout = len(slots) + 1, self.config.ray.start_timeout_s
        trainer_join = getattr(weights, "join_sync_group", None)
        host, port = (weights.sync_address() if trainer_join is not None else (node_address(), free_port()))
        joins = [s.actor.join_sync_group.remote(host, port, rank, world, timeout, self.cuda)
                 for rank, s in enumerate(slots, start=1)]
        if trainer_join is not None:
            joins.append(trainer_join(host, port, world, timeout, self.cuda))
            group = None
        else:
            group, self._store = join_group(host, port, 0, timeout, is_master=True, nccl=self.cuda, world_size=world)
        ray.get(joins, timeout=timeout)
        return group

    def sleep(self) -> None:
        import ray

        ray.get([s.actor.sleep.remote() for s in self._slots if s.healthy])

    def wake_up(self) -> None:
        import ray

        ray.get([s.actor.wake_up.remote() for s in self._slots if s.healthy])

    @property
    def exact_reshaped_logprobs(self) -> bool:
        return all(slot.facts.get("exact_reshaped_logprobs", True) for slot in self._slots)

    @property
    def unsupported_sampling(self) -> frozenset[str]:
        return frozenset(name for slot in self._slots for name in slot.facts.get("unsupported_sampling", ()))

    def add_adapter(self, name: str, path: str) -> None:
        """Every live replica serves the adapter (so a request naming it may be dealt to any), as does a
        replacement."""
        with self._adapters_lock:
            self._each(self._live(), "add_adapter", name, path)
            self._adapters[name] = path

    def remove_adapter(self, name: str) -> None:
        with self._adapters_lock:
            self._adapters.pop(name, None)
            self._each(self._live(), "remove_adapter", name)

    def _live(self) -> list[_Slot]:
        """The slots whose replica is up (ready, or stale: waiting for the next sync)."""
        with self._changed:
            return [slot for slot in self._slots if slot.state in ("ready", "stale")]

    @property
    def scores_under_adapters(self) -> bool:
        return all(slot.facts.get("scores_under_adapters", True) for slot in self._slots)

    @property
    def streams_tokens(self) -> bool:
        return all(slot.facts.get("streams_tokens", False) for slot in self._slots)

    @property
    def cancels_calls(self) -> bool:
        return all(slot.facts.get("cancels_calls", False) for slot in self._slots)

    @property
    def continuous_batching(self) -> bool:
        return all(slot.facts.get("continuous_batching", False) for slot in self._slots)

    @property
    def crosses_syncs(self) -> bool:
        """Every replica takes a sync under its calls in flight (vLLM's): so does the pool, each completion's
        `token_versions` as its replica recorded them."""
        return all(slot.facts.get("crosses_syncs", False) for slot in self._slots)

    def abort_generation(self) -> bool:
        """Every live replica ends the engine call it runs; False if one could not be reached."""
        import ray

        actors = [slot.actor for slot in self._live()]
        try:
            return all(ray.get([actor.abort_generation.remote() for actor in actors], timeout=30))
        except Exception as err:  # a dead replica is found and replaced by the next call, as always
            log.warning("abort_generation did not reach every replica: %s", err)
            return False

    def engine_metrics(self) -> str:
        """Every live replica's engine metrics, its samples labelled `engine` with the replica's index."""
        return relabelled({str(slot.index): text for slot, text in self._each_result(self._live(), "engine_metrics")})

    def random_state(self) -> dict[str, torch.Tensor]:
        """Each live replica's generators, under its index (`0.cpu`, ...)."""
        return {f"{slot.index}.{name}": tensor for slot, state in self._each_result(self._live(), "random_state")
                for name, tensor in state.items()}

    def set_random_state(self, state: dict[str, torch.Tensor]) -> None:
        """Each live replica takes back its index's generators."""
        by_replica: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            index, name = key.split(".", 1)
            by_replica.setdefault(int(index), {})[name] = tensor
        for slot in self._live():
            if slot.index in by_replica:
                self._each([slot], "set_random_state", by_replica[slot.index])

    # -- status ----------------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        """Every replica: where it runs, its state, whether it answers, its weight version and queued tokens.
        A replica found dead here is replaced as if a call had seen it die."""
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
            rows.append({"replica": slot.index, "node": slot.facts.get("node"), "node_id": slot.facts.get("node_id"),
                         "pid": slot.facts.get("pid"),
                         "bundle": self._layout.where["sampler"][slot.index], "state": slot.state,
                         "healthy": healthy, "weight_version": slot.weight_version,
                         "queued_tokens": slot.queued_tokens, "replacements": slot.replacements,
                         **({"error": slot.error} if slot.error else {})})
        return rows

    def close(self) -> None:
        self.job.release()
