"""One sampler replica of a pool: any registered sampler, in its own Ray actor.

Weights reach it by one of two routes (`sampler.sync`), both ending in one
`load_weights` over an iterator, which the sampler writes in place where it can:
- through Ray's object store (`begin_load`, `put_bucket` per bucket, `end_load`);
- by broadcast in a collective group whose rank 0 is the trainer (or the driver)
  and whose other members are the replicas (`join_sync_group`, `receive_broadcast`;
  gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict

import torch

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.ray_job import this_node
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.locks import SharedLock
from arctic_rl_core.samplers.stored_buckets import StoredBucket, loaded
from arctic_rl_core.samplers.bucket_protocol import join_group, receive_buckets
from arctic_rl_core.types import Completion, SamplingParams


_KEPT_CANCELLATIONS = 512


class SamplerReplica:
    def __init__(self, config: dict, index: int):
        from arctic_rl_core.plugins.manager import load_plugins

        cfg = BackendConfig.model_validate(config)
        # The replica itself receives the weights; its sampler takes them in this process.
        cfg.sampler.replicas, cfg.sampler.placement, cfg.sampler.sync = 1, "in_process", "shared_memory"
        self.index = index
        self.sampler = load_plugins().sampler_factory(cfg.sampler.name)(cfg)
        self.weight_version = 0
        # Weight loads, sleep and wake-up hold it alone. Calls hold it shared where the sampler takes concurrent
        # calls (vLLM's engine loop joins them into its running batch), alone where it does not.
        self._busy = SharedLock()
        self._incoming: queue.Queue | None = None
        self._loader: threading.Thread | None = None
        self._loaded: tuple[int | None, BaseException | None] = (None, None)
        self._loading = 0
        self._group = None
        self._cancellations: OrderedDict[str, Cancellation] = OrderedDict()
        """By call id: the calls in flight that the pool may cancel, and calls cancelled before they arrived (the
        actor runs calls on threads of its own, so a cancel may overtake its call; a few hundred are kept)."""
        self._cancellations_lock = threading.Lock()

    def facts(self) -> dict:
        return {**this_node(), "pid": os.getpid(), "max_context": self.sampler.max_context,
                "sync_route": self.sampler.sync_route, "exact_reshaped_logprobs": self.sampler.exact_reshaped_logprobs,
                "continuous_batching": self.sampler.continuous_batching, "crosses_syncs": self.sampler.crosses_syncs,
                "streams_tokens": self.sampler.streams_tokens, "cancels_calls": self.sampler.cancels_calls,
                "scores_under_adapters": self.sampler.scores_under_adapters,
                "unsupported_sampling": sorted(self.sampler.unsupported_sampling)}

    def _call(self):
        return self._busy.shared() if self.sampler.concurrent_generate else self._busy

    def samples_in_flight(self) -> list[int]:
        """Tokens so far of each sample its engine is sampling now (none where the sampler does not say)."""
        return self.sampler.samples_in_flight() if hasattr(self.sampler, "samples_in_flight") else []

    def _load(self):
        """A sampler that crosses syncs takes new weights under the calls in flight, which go on under them;
        another waits for them."""
        return self._busy.shared() if self.sampler.crosses_syncs else self._busy

    def generate(self, prompts, sampling: SamplingParams, on_tokens=None, call_id: str | None = None) -> list[Completion]:
        """`call_id`: the pool's name for the call, which `cancel(call_id)` ends early."""
        extra = {} if on_tokens is None else {"on_tokens": on_tokens}
        if call_id is not None and self.sampler.cancels_calls:
            extra["cancel"] = self._cancellation(call_id)
        try:
            with self._call():
                return self.sampler.generate(prompts, sampling, self.weight_version, **extra)
        finally:
            if call_id is not None:
                with self._cancellations_lock:
                    self._cancellations.pop(call_id, None)

    def cancel(self, call_id: str) -> None:
        """End the call `call_id` at its engine's next step: it returns what it sampled so far."""
        self._cancellation(call_id).cancel()

    def _cancellation(self, call_id: str) -> Cancellation:
        with self._cancellations_lock:
            cancellation = self._cancellations.setdefault(call_id, Cancellation())
            while len(self._cancellations) > _KEPT_CANCELLATIONS:
                self._cancellations.popitem(last=False)
        return cancellation

    def generate_stream(self, prompts, sampling: SamplingParams, call_id: str | None = None):
        """`generate` as a Ray streaming generator (`num_returns="streaming"`): ("tokens", [(prompt index, sample
        index, token ids, log-probs, top log-probs), ...]) with what the engine sampled since the last item, then
        ("done", completions)."""
        heard: queue.SimpleQueue = queue.SimpleQueue()
        outcome: dict = {}

        def run():
            try:
                outcome["done"] = self.generate(prompts, sampling, lambda *tokens: heard.put(tokens), call_id)
            except BaseException as err:  # raised to the caller below
                outcome["error"] = err
            finally:
                heard.put(None)

        threading.Thread(target=run, name="arctic-rl-replica-stream", daemon=True).start()
        while True:
            batch = [heard.get()]
            while not heard.empty():
                batch.append(heard.get())
            if batch[-1] is None:
                if batch[:-1]:
                    yield "tokens", batch[:-1]
                break
            yield "tokens", batch
        if "error" in outcome:
            raise outcome["error"]
        yield "done", outcome["done"]

    def add_adapter(self, name: str, path: str) -> None:
        self.sampler.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.sampler.remove_adapter(name)

    def abort_generation(self) -> bool:
        return self.sampler.abort_generation()  # not under _busy: it ends the call that holds it

    def engine_metrics(self) -> str:
        return self.sampler.engine_metrics()  # not under _busy: a scrape never waits for a call

    def random_state(self) -> dict[str, torch.Tensor]:
        return self.sampler.random_state()  # not under _busy: a checkpoint does not wait for the calls in flight

    def set_random_state(self, state: dict[str, torch.Tensor]) -> None:
        self.sampler.set_random_state(state)

    def score(self, sequences):
        with self._call():
            return self.sampler.score(sequences)

    def sleep(self) -> None:
        with self._busy:
            self.sampler.sleep()

    def wake_up(self) -> None:
        with self._busy:
            self.sampler.wake_up()

    def export_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """A copy of the weights it holds, in checkpoint naming, for a replacement peer; None where the
        sampler cannot give them."""
        with self._busy:
            held = self.sampler.held_weights()
            return None if held is None else [(name, tensor.detach().clone()) for name, tensor in held]

    # -- through the object store ----------------------------------------------------------------

    def begin_load(self, version: int) -> None:
        """A thread feeds the sampler's one `load_weights` iterator from the buckets as they arrive."""
        self._incoming, self._loading = queue.Queue(maxsize=1), version
        self._loaded = (None, None)

        def stream():
            while (bucket := self._incoming.get()) is not None:
                yield from bucket

        def load():
            try:
                with self._load():
                    self._loaded = (self.sampler.load_weights(stream(), version), None)
            except BaseException as err:  # reported by end_load
                self._loaded = (None, err)
                while self._incoming.get() is not None:  # let the sender finish
                    pass

        self._loader = threading.Thread(target=load, name="arctic-rl-replica-load", daemon=True)
        self._loader.start()

    def put_bucket(self, bucket: StoredBucket) -> None:
        self._incoming.put(loaded(bucket))  # waits while the loader holds the previous bucket

    def end_load(self) -> int:
        self._incoming.put(None)
        self._loader.join()
        count, err = self._loaded
        if err is not None:
            raise err
        self.weight_version = self._loading
        return count

    # -- by broadcast ----------------------------------------------------------------------------

    def join_sync_group(self, host: str, port: int, rank: int, world: int, timeout_s: float, nccl: bool) -> None:
        self._group = None  # a previous group (before a member was replaced) is left
        self._group, self._store = join_group(host, port, rank, timeout_s, is_master=False, nccl=nccl,
                                              world_size=world)

    def receive_broadcast(self, version: int) -> int:
        """Loads the source's buckets as they arrive until its end marker (drained after a failed load)."""
        # Copies: a sampler may hold on to tensors across buckets (vLLM checks names and shapes on first sync).
        buckets = receive_buckets(self._group, self, copy=True)
        try:
            with self._load():
                count = self.sampler.load_weights(buckets, version)
        finally:
            buckets.close()
        self.weight_version = version
        return count
