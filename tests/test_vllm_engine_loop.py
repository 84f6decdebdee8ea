"""The loop that drives vLLM's engine for every caller, on a scripted engine with vLLM's interface (add_request, step,
abort_request, has_unfinished_requests): requests join between steps, each call answers on its own, an abort
returns what was sampled, a cancelled call ends alone with what it sampled, a weight update cuts requests in flight and they go on from what they sampled with each
token's version, a failing step fails the callers in flight and the loop refuses later work; where the engine's core
is a process of its own, work arriving while the loop waits for that core is taken at once.
(On the real engine: tests/test_vllm_sampler.py.)"""

import queue
import threading
from types import SimpleNamespace

import pytest

from vllm import SamplingParams

from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.samplers.vllm_engine_loop import EngineLoop


class ScriptedEngine:
    """Each step gives every running request one token (its length so far + 100) and finishes it at `max_tokens`."""

    def __init__(self):
        self.running: dict[str, dict] = {}
        self.steps = 0
        self.fail_at_step: int | None = None
        self.threads: set[str] = set()
        self.step_gate = threading.Semaphore(0)
        self.free_running = True
        self.added: list = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.threads.add(threading.current_thread().name)
        if params.max_tokens > 1000:
            raise ValueError("max_tokens too large")
        self.running[request_id] = {"n": params.n, "left": params.max_tokens, "made": 0}
        self.added.append((prompt["prompt_token_ids"], params))

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_ids, internal=False):
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def step(self):
        if not self.running:  # the step after an abort frees the batch: vLLM's core in process returns at once
            return []
        if not self.free_running:
            self.step_gate.acquire()
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("device lost")
        outputs = []
        for request_id, state in list(self.running.items()):
            state["made"] += 1
            state["left"] -= 1
            done = state["left"] == 0
            deltas = [SimpleNamespace(index=i, token_ids=[100 + state["made"]], logprobs=[{100 + state["made"]: -0.5}],
                                      finish_reason="length" if done else None) for i in range(state["n"])]
            outputs.append(SimpleNamespace(request_id=request_id, outputs=deltas, finished=done, prompt_logprobs=None))
            if done:
                del self.running[request_id]
        return outputs


class CoreProcessEngine(ScriptedEngine):
    """As vLLM's `LLMEngine` over a core in another process (`SyncMPClient`): `step()` waits for that core's next
    outputs in a queue. Here the core sends a step's outputs only when the test puts "step" in it."""

    def __init__(self):
        super().__init__()
        self.engine_core = SimpleNamespace(outputs_queue=queue.Queue())

    def step(self):
        outputs = self.engine_core.outputs_queue.get()
        if outputs != "step":
            assert not outputs.outputs  # the loop's wake-up: vLLM's empty `EngineCoreOutputs`
            return []
        return super().step()


def _waiting_on_the_core():
    """(engine, loop, the request's future): a loop over a core process with one 50-token request in flight, after
    one step. The loop waits in `step()` for outputs the core will not send until the test puts "step"."""
    engine = CoreProcessEngine()
    loop = EngineLoop(lambda: SimpleNamespace(llm_engine=engine))
    running = loop.submit([{"prompt_token_ids": [1]}], _params(50))
    engine.engine_core.outputs_queue.put("step")
    while engine.steps < 1:
        threading.Event().wait(0.001)
    return engine, loop, running


def _params(max_tokens, n=1):
    return SamplingParams(max_tokens=max_tokens, n=n)


@pytest.fixture
def loop():
    engine = ScriptedEngine()
    loop = EngineLoop(lambda: SimpleNamespace(llm_engine=engine))
    loop.engine = engine
    yield loop
    engine.free_running = True
    engine.step_gate.release(10_000)
    loop.close()


def _steps(loop, count):
    """Let the scripted engine take `count` more steps, and wait for them."""
    target = loop.engine.steps + count
    loop.engine.step_gate.release(count)
    while loop.engine.steps < target:
        threading.Event().wait(0.001)


def _hold(loop):
    """`loop.hold()`, taken at the next step boundary: after the step the loop may be waiting in."""
    holding = threading.Thread(target=loop.hold)
    holding.start()
    loop.engine.step_gate.release(1)
    holding.join(10)
    assert not holding.is_alive()


def test_a_short_call_returns_while_a_long_one_runs_and_every_use_is_on_the_loops_thread(loop):
    loop.engine.free_running = False
    long = loop.submit([{"prompt_token_ids": [1]}] * 2, _params(50, n=2))
    _steps(loop, 2)
    short = loop.submit([{"prompt_token_ids": [2]}], _params(3))
    _steps(loop, 4)  # the step the loop waited in, then the short request's three
    assert [s.token_ids for s in short.result(10)[0].samples] == [[101, 102, 103]]
    assert not long.done()  # it joined the running batch, not a queue behind the long call
    loop.engine.free_running = True
    loop.engine.step_gate.release(100)
    results = long.result(10)
    assert all(s.token_ids == list(range(101, 151)) and s.finish_reason == "length" for r in results for s in r.samples)
    assert loop.call(threading.current_thread) is loop._thread
    assert loop.engine.threads == {loop._thread.name}


def test_an_abort_returns_what_each_sample_reached(loop):
    loop.engine.free_running = False
    running = loop.submit([{"prompt_token_ids": [1]}], _params(100, n=2))
    _steps(loop, 5)
    aborting = threading.Thread(target=loop.abort_all)
    aborting.start()  # taken at the next step boundary: after the step the loop may be waiting in
    loop.engine.step_gate.release(1)
    aborting.join(10)
    [result] = running.result(10)
    assert [s.finish_reason for s in result.samples] == ["abort", "abort"]
    assert all(5 <= len(s.token_ids) <= 6 and len(s.logprobs) == len(s.token_ids) for s in result.samples)
    assert loop.in_flight == 0 and not loop.engine.running


def test_cancelling_a_call_ends_its_requests_alone_and_it_returns_what_they_sampled(loop):
    loop.engine.free_running = False
    cancelled = loop.submit([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}], _params(100, n=2))
    other = loop.submit([{"prompt_token_ids": [3]}], _params(12))
    _steps(loop, 5)
    loop.cancel(cancelled)  # returns at once: a client's disconnect is heard on the server's event loop
    _steps(loop, 1)  # taken at the next step boundary, after the step the loop may be waiting in
    results = cancelled.result(10)
    samples = [s for r in results for s in r.samples]
    assert len(samples) == 4 and {s.finish_reason for s in samples} == {"abort"}
    assert all(5 <= len(s.token_ids) <= 6 and len(s.logprobs) == len(s.token_ids) for s in samples)
    assert len(loop.engine.running) == 1 and loop.in_flight == 1  # the other call's request alone goes on
    loop.engine.free_running = True
    loop.engine.step_gate.release(100)
    assert other.result(10)[0].samples[0].token_ids == list(range(101, 113))
    loop.cancel(other)  # already answered: nothing changes
    assert loop.call(lambda: loop.in_flight) == 0


def test_a_call_cancelled_while_a_weight_update_holds_it_ends_with_what_it_had(loop):
    loop.engine.free_running = False
    cut = loop.submit([{"prompt_token_ids": [1]}], _params(50))
    _steps(loop, 4)
    _hold(loop)
    try:
        waiting = loop.submit([{"prompt_token_ids": [2]}], _params(5, n=3))  # never added: the hold defers it
        loop.cancel(cut)
        loop.cancel(waiting)
        [held] = cut.result(10)
        assert held.samples[0].finish_reason == "abort" and 4 <= len(held.samples[0].token_ids) <= 5
        assert [(s.token_ids, s.finish_reason) for s in waiting.result(10)[0].samples] == [([], "abort")] * 3
    finally:
        loop.release(version=1)
    assert loop.in_flight == 0 and not loop.engine.running and len(loop.engine.added) == 1


def test_a_request_the_engine_refuses_fails_its_call_alone_and_leaves_nothing_running(loop):
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}], _params(5000)).result(10)
    assert not loop.engine.running
    assert len(loop.submit([{"prompt_token_ids": [1]}], _params(2)).result(10)[0].samples[0].token_ids) == 2


def test_a_failing_step_fails_the_calls_in_flight_and_the_loop_refuses_later_work(loop):
    loop.engine.fail_at_step = 3
    with pytest.raises(ArcticRLError, match="device lost"):
        loop.submit([{"prompt_token_ids": [1]}], _params(10)).result(10)
    with pytest.raises(ArcticRLError, match="stopped"):
        loop.submit([{"prompt_token_ids": [1]}], _params(2))


def test_a_weight_update_cuts_requests_in_flight_and_each_sample_goes_on_from_its_tokens_under_the_new_version(loop):
    loop.engine.free_running = False
    running = loop.submit([{"prompt_token_ids": [7, 8]}], _params(40, n=2))
    _steps(loop, 6)
    _hold(loop)
    try:
        waiting = loop.submit([{"prompt_token_ids": [9]}], _params(3))  # arrives while held: waits
        assert not loop.engine.running and loop.in_flight == 2
        assert not waiting.done() and len(loop.engine.added) == 1
        cut = [s.token_ids for s in loop.cut_samples()]
    finally:
        loop.release(version=1)
    loop.engine.free_running = True
    loop.engine.step_gate.release(10_000)
    [result] = running.result(10)
    assert all(6 <= len(tokens) <= 7 for tokens in cut)
    # each sample went on as a request of its own: prompt + its tokens, the rest of its budget
    continued = loop.engine.added[1:3]
    assert sorted((prompt, params.max_tokens, params.n) for prompt, params in continued) == sorted(
        ([7, 8] + tokens, 40 - len(tokens), 1) for tokens in cut)
    for sample, before in zip(result.samples, cut):
        assert len(sample.token_ids) == len(sample.versions) == len(sample.logprobs) == 40
        assert sample.token_ids[:len(before)] == before and sample.finish_reason == "length"
        assert sample.versions == [0] * len(before) + [1] * (40 - len(before))
    assert waiting.result(10)[0].samples[0].versions == [1, 1, 1]
    assert loop.version == 1 and loop.in_flight == 0


def test_holds_nest_and_an_abort_while_held_returns_what_was_sampled(loop):
    loop.engine.free_running = False
    running = loop.submit([{"prompt_token_ids": [1]}], _params(30))
    _steps(loop, 4)
    _hold(loop)
    with loop.held(version=5):
        pass
    assert loop.version == 5 and len(loop.cut_samples()) == 1  # the outer hold still stands
    loop.abort_all()
    [result] = running.result(10)
    assert result.samples[0].finish_reason == "abort" and 4 <= len(result.samples[0].token_ids) <= 5
    loop.release()
    assert loop.in_flight == 0 and not loop.engine.running


def test_work_arriving_while_the_loop_waits_on_a_core_process_is_taken_without_waiting_for_its_step():
    engine, loop, long = _waiting_on_the_core()
    try:
        answered = []
        caller = threading.Thread(target=lambda: answered.append(loop.call(lambda: len(engine.running))))
        caller.start()
        caller.join(10)
        assert answered == [1]
        short = loop.submit([{"prompt_token_ids": [2]}], _params(2))
        loop.call(lambda: None)  # the short request was added before this call ran
        assert len(engine.added) == 2 and engine.steps == 1
        for _ in range(2):
            engine.engine_core.outputs_queue.put("step")
        assert [s.token_ids for s in short.result(10)[0].samples] == [[101, 102]]
        assert not long.done()
    finally:
        for _ in range(100):
            engine.engine_core.outputs_queue.put("step")
        loop.close()


def test_closing_a_loop_that_waits_on_a_core_process_ends_it_at_once():
    engine, loop, running = _waiting_on_the_core()
    # Closing must not wait for the core's outputs.
    closer = threading.Thread(target=loop.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    with pytest.raises(ArcticRLError, match="closed"):
        running.result(0)
