"""Async rollout pipelining over the training API: overlap, staleness bound, dropping."""

import threading
import time
from concurrent.futures import Future

import pytest

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.pipeline import RolloutPipeline
from arctic_rl_core.types import SamplingParams, Sequence


class Recorder:
    """Wraps a TrainingAPI and records when each call started and ended.

    With `await_overlap`, the n-th `fwd_bwd` (n from 0) first waits until generation n + 1 (the next step's
    rollout) has started, and records whether it did within the deadline (`overlapped`): generation that
    overlaps training has started by then; generation that only starts after training never does."""

    OVERLAP_DEADLINE_S = 30.0  # only bounds a hang: the next step's generation is already submitted

    def __init__(self, api, await_overlap=False):
        self.api = api
        self.events = []
        self.lock = threading.Lock()
        self.generation_started = threading.Condition(self.lock)
        self.generates_started = 0
        self.await_overlap = await_overlap
        self.overlapped = []
        self.futures = type(api).futures.func(self)  # futures over this wrapper

    def _timed(self, name, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        with self.lock:
            self.events.append((name, start, time.perf_counter()))
        return result

    def generate(self, *args, **kwargs):
        with self.lock:
            self.generates_started += 1
            self.generation_started.notify_all()
        return self._timed("generate", self.api.generate, *args, **kwargs)

    def fwd_bwd(self, *args, **kwargs):
        if self.await_overlap:
            with self.lock:
                wanted = len(self.overlapped) + 2  # this step's generation and the next one's
                deadline = self.OVERLAP_DEADLINE_S if all(self.overlapped) else 0  # one hang is enough to fail
                self.overlapped.append(
                    self.generation_started.wait_for(lambda: self.generates_started >= wanted, deadline))
        return self._timed("fwd_bwd", self.api.fwd_bwd, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.api, name)


def train_steps(api, pipeline, steps, extra_syncs=0):
    batches = []
    for _ in range(steps):
        batch = pipeline.next_batch()
        batches.append(batch)
        seqs = [Sequence(prompt_ids=batch.prompts[c.prompt_index], response_ids=c.token_ids, group_id=c.prompt_index,
                         advantages=[1.0 if i % 2 else -1.0] * len(c.token_ids), behaviour_logprobs=c.logprobs,
                         behaviour_version=c.weight_version)
                for i, c in enumerate(batch.completions)]
        if seqs:
            api.fwd_bwd(seqs, {"name": "grpo", "config": {"use_decoupled_loss": True, "prox_logp_method": "loglinear"}})
            api.step()
        if extra_syncs:
            pipeline.wait_for_pending()  # the pre-started generation used the old weights, deterministically
        else:
            pipeline.wait_for_oldest()  # as the recipe driver does: the rollout in flight samples the old weights
        for _ in range(1 + extra_syncs):
            api.sync_weights()
    pipeline.close()
    return batches


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_synchronous_pipeline_generates_after_each_sync(make_backend):
    api = Recorder(make_backend())
    pipeline = RolloutPipeline(api, lambda step: PROMPTS, SamplingParams(n=2, max_tokens=6, seed=0), max_staleness=0)
    batches = train_steps(api, pipeline, 3)
    assert [b.staleness for b in batches] == [0, 0, 0] and pipeline.dropped_total == 0
    assert [b.completions[0].weight_version for b in batches] == [0, 1, 2]
    generates = [e for e in api.events if e[0] == "generate"]
    trains = [e for e in api.events if e[0] == "fwd_bwd"]
    for gen, train in zip(generates[1:], trains):  # step t+1's generate starts after step t trained
        assert gen[1] >= train[2]


def test_one_step_off_policy_overlaps_generation_with_training(make_backend):
    api = Recorder(make_backend(), await_overlap=True)
    pipeline = RolloutPipeline(api, lambda step: PROMPTS, SamplingParams(n=2, max_tokens=6, seed=0), max_staleness=1)
    batches = train_steps(api, pipeline, 4)
    assert [b.staleness for b in batches] == [0, 1, 1, 1] and pipeline.dropped_total == 0
    assert [b.completions[0].weight_version for b in batches] == [0, 0, 1, 2]
    # step t+1's generation had started before step t's fwd_bwd ran (and so before it ended): every step overlapped
    assert api.overlapped == [True] * 4


def test_samples_beyond_the_staleness_bound_are_dropped_and_counted(make_backend):
    api = make_backend()
    pipeline = RolloutPipeline(api, lambda step: PROMPTS, SamplingParams(n=2, max_tokens=4, seed=0), max_staleness=1)
    batches = train_steps(api, pipeline, 3, extra_syncs=1)  # two versions per step: pre-generated batches are 2 behind
    assert batches[0].dropped == 0 and len(batches[0].completions) == 4
    assert all(b.dropped == 4 and not b.completions for b in batches[1:])
    assert pipeline.dropped_total == 8


def test_bad_staleness_is_refused(make_backend):
    with pytest.raises(InvalidRequest, match="pipeline.max_staleness"):
        RolloutPipeline(make_backend(), lambda step: PROMPTS, SamplingParams(), max_staleness=-1)


class HeldGenerations:
    """`futures.generate` of a TrainingAPI whose generations finish when the test says: the first at once."""

    weight_version = 0

    def __init__(self):
        self.futures = self
        self.started: list[Future] = []

    def generate(self, prompts, sampling):
        future = Future()
        if not self.started:
            future.set_result([])
        self.started.append(future)
        return future


def test_the_rollout_wait_before_a_sync_is_for_the_oldest_generation_in_flight():
    """What a weight sync waits for in a pipeline two steps ahead: the oldest rollout, which holds the sampler."""
    api = HeldGenerations()
    pipe = RolloutPipeline(api, lambda step: PROMPTS, SamplingParams(n=1), max_staleness=2)
    pipe.next_batch()
    oldest, newest = api.started[1:]
    waiter = threading.Thread(target=pipe.wait_for_oldest)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the next step's rollout is still generating
    oldest.set_result([])
    waiter.join(10)
    assert not waiter.is_alive() and not newest.done()  # the one after it is not waited for
    newest.set_result([])
