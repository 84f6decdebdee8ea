"""`engine.ranks: N`: N DeepSpeed ranks as Ray actors, driven as one training engine.

The backend's process is the driver. It validates a call and builds its
micro-batches exactly as for one rank (every loss denominator is the whole
batch's), deals them to ranks by `rank_plan.plan_ranks` (GRPO groups whole on
one rank, balanced by computed tokens, equal counts per rank), and gathers the
results in the caller's order. DeepSpeed averages gradients over the ranks, so
each rank's loss is scaled by N: the sum over ranks of the per-rank gradients
is the gradient of the whole batch, and the update equals one rank's on the
whole batch. Every collective (ZeRO-3 gathers, gradient reductions, weight
gathers for sync) is entered by all ranks in the same order, because the driver
sends each call to all ranks before waiting and never overlaps two calls.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Iterator

import torch

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.base import TrainingEngine
from arctic_rl_core.engines.distributed import free_port
from arctic_rl_core.engines.rank_plan import RankPlan, plan_ranks
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.models.lora_shape import AdapterLayout, AdapterShape
from arctic_rl_core.ray_job import RayJob, node_address, this_node
from arctic_rl_core.samplers.bucket_protocol import BucketSender, join_group
from arctic_rl_core.samplers.stored_buckets import StoredBucket, loaded, stored


class TrainerRankFailed(ArcticRLError):
    """A trainer rank died or failed: the call did not apply; the job resumes from its last checkpoint."""


class TrainerRank:
    """One rank, in its own Ray actor: a DeepSpeedEngine in a world of `world` ranks."""

    def __init__(self, config: dict, rank: int, world: int):
        self.config, self.rank, self.world = config, rank, world
        self.engine = None
        self._weights: Iterator | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        return node_address(), free_port()

    def start(self, master_addr: str, master_port: int) -> dict:
        # Ray gives each actor its own devices (CUDA_VISIBLE_DEVICES), so the local rank is 0.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from arctic_rl_core.engines.deepspeed_engine import DeepSpeedEngine

        self.engine = DeepSpeedEngine(BackendConfig.model_validate(self.config))
        e = self.engine
        return {"max_context": e.max_context, "vocab_size": e.vocab_size, "pad_token_id": e.pad_token_id,
                "zorro_loaded": e.zorro_loaded, "replay_shape": e.replay_shape, **this_node(), "pid": os.getpid()}

    def forward_backward(self, micro_batches, scales, loss, loss_config, post, keep_outputs, with_entropy):
        return self.engine.forward_backward(micro_batches, loss, loss_config, post, scales=scales,
                                            keep_outputs=keep_outputs, with_entropy=with_entropy)

    def forward(self, micro_batches, post, with_entropy):
        return [out for _, out in self.engine.forward(micro_batches, post, with_entropy)]

    def discard_gradients(self) -> None:
        self.engine.discard_gradients()

    def optimizer_step(self, learning_rate, adam):
        return self.engine.optimizer_step(learning_rate, adam)

    def counters(self) -> tuple[bool, int]:
        return self.engine.has_gradients, self.engine.steps

    def weights_bucket(self, bucket_bytes: int, restart: bool) -> tuple[StoredBucket, bool]:
        """The next ~`bucket_bytes` of full weights (rank 0 returns them, for the object store; the other ranks
        take part in the ZeRO-3 gathers and return none), and whether more follow."""
        if restart or self._weights is None:
            self._weights = self.engine.named_full_weights()
        out, size = [], 0
        for name, tensor in self._weights:
            if self.rank == 0:
                out.append((name, tensor.detach().cpu().clone()))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                return stored(out), True
        self._weights = None
        return stored(out), False

    def join_sync_group(self, host: str, port: int, world: int, timeout_s: float, nccl: bool) -> None:
        """Rank 0 only: become rank 0 (the source) of the sampler replicas' weight-sync group."""
        self._sync_group = None  # a previous group (before a replica was replaced) is left
        self._sync_group, self._sync_store = join_group(host, port, 0, timeout_s, is_master=True, nccl=nccl,
                                                        world_size=world)

    def broadcast_weights(self, bucket_bytes: int) -> int:
        """Every rank takes part in gathering full weights (ZeRO-3: bucket by bucket); rank 0 broadcasts them
        to the replicas. A failed send does not stop rank 0 gathering: the ranks stay in step."""
        sender = BucketSender(self._sync_group, bucket_bytes, owner=self) if self.rank == 0 else None
        failure, count = None, 0
        for name, tensor in self.engine.named_full_weights():
            count += 1
            if sender is not None and failure is None:
                try:
                    sender.add(name, tensor)
                except Exception as err:
                    failure = err
        if sender is not None and failure is None:
            try:
                sender.close()
            except Exception as err:
                failure = err
        if failure is not None:
            raise ArcticRLError(f"sync_weights: broadcasting to the sampler replicas failed: {failure}")
        return count

    def save(self, path: str, client_state: dict, trainable_only: bool = False) -> None:
        self.engine.save(path, client_state, trainable_only)

    def load(self, path: str, trainable_only: bool = False, optimizer: bool = True) -> dict:
        return self.engine.load(path, trainable_only, optimizer)

    def save_adapter(self, path: str) -> None:
        self.engine.save_adapter(path)

    def adapter_layout(self):
        return self.engine.adapter_layout()

    def shape_adapter(self, shape) -> None:
        self.engine.shape_adapter(shape)

    def state_digest(self) -> str:
        return self.engine.state_digest()


class RankZeroWeights:
    """The full weights, leaving rank 0 bucket by bucket while every rank takes part in the gathers.

    Iterating it brings each bucket into this process. A sampler pool instead passes `bucket_refs()` on to
    its replicas: the buckets go from rank 0's object store to them without passing through the driver."""

    def __init__(self, group: "TrainerGroup"):
        self.group = group

    def bucket_refs(self) -> Iterator:
        more, restart = True, True
        while more:
            calls = [actor.weights_bucket.options(num_returns=2).remote(self.group.bucket_bytes, restart)
                     for actor in self.group.actors]
            more = self.group._wait([more_ref for _, more_ref in calls])[0]
            restart = False
            yield calls[0][0]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for ref in self.bucket_refs():
            yield from loaded(self.group._wait([ref])[0])

    # A sampler pool syncing by broadcast makes rank 0 the source of its group.
    def sync_address(self) -> tuple[str, int]:
        return self.group._wait([self.group.actors[0].rendezvous_address.remote()])[0]

    def join_sync_group(self, host: str, port: int, world: int, timeout_s: float, nccl: bool):
        """Rank 0 joins (as the group's master) while the replicas join; returns its pending call."""
        return self.group.actors[0].join_sync_group.remote(host, port, world, timeout_s, nccl)

    def broadcast(self, bucket_bytes: int) -> None:
        self.group._all("broadcast_weights", bucket_bytes)


class TrainerGroup(TrainingEngine):
    concurrent_forward = False  # one call at a time: every rank must enter the same collectives in the same order

    def __init__(self, config: BackendConfig):
        import ray

        from arctic_rl_core.engines.deepspeed_engine import refuse_unsupported

        refuse_unsupported(config)
        self.ranks = config.engine.ranks
        self.bucket_bytes = config.engine.weight_bucket_mb * 2**20
        self.job = RayJob.acquire(config)
        self.failed: str | None = None
        """Why the group cannot take calls any more (a rank died, failed or hung)."""
        self.call_timeout_s = config.ray.call_timeout_s
        try:
            layout = self.job.layout(config)
            payload = config.model_dump(mode="json")
            self.actors = [self.job.actor(TrainerRank, payload, rank, self.ranks, **layout.trainer[rank])
                           for rank in range(self.ranks)]
            addr, port = ray.get(self.actors[0].rendezvous_address.remote(), timeout=config.ray.start_timeout_s)
            facts = self._all("start", addr, port, limit=(config.ray.start_timeout_s, "ray.start_timeout_s"))
        except BaseException:
            self.job.release()
            raise
        first = facts[0]
        self.max_context, self.vocab_size = first["max_context"], first["vocab_size"]
        self.pad_token_id, self.zorro_loaded = first["pad_token_id"], first["zorro_loaded"]
        self.replay_shape = first["replay_shape"]
        self._where = [{"rank": r, "node": f["node"], "node_id": f["node_id"], "pid": f["pid"], "bundle": b}
                       for (r, f), b in zip(enumerate(facts), layout.where["trainer"])]
        self.last_plan: RankPlan | None = None
        """The plan of the last fwd_bwd or log_probs: which micro-batches each rank ran."""

    @property
    def placement(self) -> list[dict]:
        """Every rank: where it runs and whether the group can still take calls."""
        return [{**row, "healthy": self.failed is None} for row in self._where]

    # -- calls to every rank ---------------------------------------------------------------------

    def _wait(self, refs: list, limit: tuple[float, str] | None = None) -> list:
        """The ranks' results in order. The first failure is raised at once: a rank that died leaves the others
        blocked in a collective, so the group is marked failed and refuses every later call."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

        if self.failed:
            raise TrainerRankFailed(self.failed)
        pending = list(refs)
        seconds, setting = limit or (self.call_timeout_s, "ray.call_timeout_s")
        deadline = time.monotonic() + seconds
        rank = None
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    ranks = [r for r, ref in enumerate(refs) if ref in pending]  # refs go to ranks 0, 1, ...
                    self.failed = (f"trainer ranks {ranks} did not answer within {setting}={seconds:g} s; the call "
                                   "was not applied and the group cannot continue: start a new job and "
                                   "load_checkpoint to resume from the last checkpoint")
                    raise TrainerRankFailed(self.failed)
                rank = refs.index(ready[0])
                ray.get(ready)
            return ray.get(refs)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, ArcticRLError):  # a refusal (InvalidRequest ...) raised on the ranks
                raise cause from None
            self.failed = f"a trainer rank failed: {err}"
        except RayActorError as err:
            where = getattr(self, "_where", None)
            who = "a trainer rank" if rank is None else f"trainer rank {rank}"
            if where and rank is not None:
                who += f" on node {where[rank]['node']} ({where[rank]['node_id']})"
            if isinstance(err, ActorUnavailableError):  # seen before Ray declares the process or node dead
                what = "is unreachable (its process or node is gone, or the network to it)"
            else:
                what = f"died ({'its node died' if 'node has died' in str(err) else type(err).__name__})"
            self.failed = (f"{who} {what}; the call was not applied and the group cannot continue: start a new job "
                           "and load_checkpoint to resume from the last checkpoint")
        except RayError as err:
            self.failed = f"a trainer rank failed: {err}"
        raise TrainerRankFailed(self.failed)

    def _all(self, method: str, *args, limit: tuple[float, str] | None = None) -> list:
        return self._wait([getattr(actor, method).remote(*args) for actor in self.actors], limit)

    def _per_rank(self, plan: RankPlan, micro_batches: list[MicroBatch]):
        for rank in range(self.ranks):
            own = [micro_batches[i] for i in plan.micro_batches[rank]]
            yield rank, own + [micro_batches[plan.filler]] * plan.fillers[rank], len(own)

    # -- TrainingEngine --------------------------------------------------------------------------

    def forward_backward(self, micro_batches, loss, loss_config, post, scales=None, keep_outputs=False,
                         with_entropy=False):
        plan = self.last_plan = plan_ranks(micro_batches, self.ranks)
        refs = []
        for rank, batch, own in self._per_rank(plan, micro_batches):
            given = [1.0 if scales is None else scales[i] for i in plan.micro_batches[rank]]
            rank_scales = [s * self.ranks for s in given] + [0.0] * plan.fillers[rank]
            refs.append(self.actors[rank].forward_backward.remote(batch, rank_scales, loss, loss_config, post,
                                                                  keep_outputs, with_entropy))
        results = self._wait(refs)
        metrics: dict[str, float] = {}
        for _, rank_metrics, _ in results:
            for name, value in rank_metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        kept = None
        if keep_outputs:  # back in the caller's micro-batch order; a rank's fillers come after its own
            by_index = {i: out for rank, (_, _, outs) in enumerate(results)
                        for i, out in zip(plan.micro_batches[rank], outs)}
            kept = [by_index[i] for i in range(len(micro_batches))]
        return sum(value for value, _, _ in results), metrics, kept

    def forward(self, micro_batches, post, with_entropy):
        plan = self.last_plan = plan_ranks(micro_batches, self.ranks)
        refs = [self.actors[rank].forward.remote(batch, post, with_entropy)
                for rank, batch, _ in self._per_rank(plan, micro_batches)]
        outputs: dict[int, dict] = {}
        for rank, rank_outputs in enumerate(self._wait(refs)):
            for index, out in zip(plan.micro_batches[rank], rank_outputs):
                outputs[index] = out
        return [(mb, outputs[i]) for i, mb in enumerate(micro_batches)]

    def discard_gradients(self) -> None:
        self._all("discard_gradients")

    def optimizer_step(self, learning_rate, adam=None):
        return self._all("optimizer_step", learning_rate, adam)[0]

    @property
    def has_gradients(self) -> bool:
        return self._wait([self.actors[0].counters.remote()])[0][0]

    @property
    def steps(self) -> int:
        return self._wait([self.actors[0].counters.remote()])[0][1]

    def named_full_weights(self) -> "RankZeroWeights":
        return RankZeroWeights(self)

    def save(self, path: str, client_state: dict, trainable_only: bool = False) -> None:
        self._all("save", path, client_state, trainable_only)

    def load(self, path: str, trainable_only: bool = False, optimizer: bool = True) -> dict:
        return self._all("load", path, trainable_only, optimizer)[0]

    def save_adapter(self, path: str) -> None:
        self._all("save_adapter", path)

    def adapter_layout(self) -> AdapterLayout | None:
        return self._wait([self.actors[0].adapter_layout.remote()])[0]

    def shape_adapter(self, shape: AdapterShape | None) -> None:
        self._all("shape_adapter", shape)

    def state_digest(self) -> str:
        return hashlib.sha256("".join(self._all("state_digest")).encode()).hexdigest()

    def close(self) -> None:
        self.job.release()
