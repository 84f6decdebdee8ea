"""One thread drives vLLM's engine for every caller: requests join the running batch between two engine steps.

vLLM's offline engine (`LLMEngine`) is continuously batched inside, but not thread-safe: driven one call at a
time, a short request sent while a long call runs waits for that whole call. Here a single thread owns the
engine (it builds it, steps it, and runs every other use of it: weight loads, cache resets, RPCs to the
workers), and callers from any thread hand it requests. A request is added at the next step boundary and its
caller is answered as soon as its own samples finish. Outputs come as deltas (vLLM's `RequestOutputKind.DELTA`),
so what a request sampled so far is known at every step: an abort returns it, with its log-probs.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from arctic_rl_core.errors import ArcticRLError


@dataclass
class Sample:
    """One of a prompt's n samples, as far as it got."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    """vLLM's log-probs per sampled position (token id -> Logprob)."""
    finish_reason: str | None = None
    """vLLM's (`stop`, `length`), or `abort`; None while it runs."""


@dataclass
class PromptResult:
    samples: list[Sample]
    prompt_logprobs: list | None = None


@dataclass
class _Call:
    """One caller's requests (one per prompt), answered when all have finished."""

    results: dict[str, PromptResult]
    future: Future
    unfinished: set[str]


class EngineLoop:
    def __init__(self, build: Callable[[], Any], name: str = "arctic-rl-vllm-engine"):
        """`build()` makes vLLM's `LLM` on the loop's thread, which then owns it."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[str, _Call] = {}  # request id -> its call
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # a command is either run or refused, never left unanswered
        built: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name=name, daemon=True)
        self._thread.start()
        self.llm = built.result()

    # -- callers' side (any thread) --------------------------------------------------------------------

    def call(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` on the engine's thread, between two steps; its result (or its exception)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        done: Future = Future()
        self._put(("call", (fn, args, kwargs), done))
        return done.result()

    def submit(self, prompts: list[dict], params) -> Future:
        """Requests (vLLM prompts, one `SamplingParams` for all) joining the running batch; the future resolves
        to a `PromptResult` per prompt once every sample of every prompt has finished or was aborted."""
        done: Future = Future()
        self._put(("add", (prompts, params), done))
        return done

    def abort_all(self) -> None:
        """End every request in flight: each call returns what its samples reached, unfinished ones `abort`."""
        done: Future = Future()
        self._put(("abort", None, done))
        done.result()

    @property
    def in_flight(self) -> int:
        """Requests (prompts) the engine is running for callers."""
        return len(self._calls)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._commands.put(("stop", None, None))
        self._thread.join(timeout=60)

    def _put(self, command) -> None:
        with self._lock:
            if self._closed:
                raise ArcticRLError("the vLLM sampler's engine loop has stopped")
            self._commands.put(command)

    # -- the engine's thread ---------------------------------------------------------------------------

    def _main(self, build, built: Future) -> None:
        try:
            llm = build()
        except BaseException as err:  # noqa: BLE001 -- the constructor's caller raises it
            built.set_exception(err)
            return self._shutdown(ArcticRLError("the vLLM sampler failed to start"))
        built.set_result(llm)
        engine = llm.llm_engine
        while True:
            # Idle: wait for work. Running: take whatever arrived, then one engine step.
            try:
                command = self._commands.get(block=not engine.has_unfinished_requests())
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return self._shutdown(ArcticRLError("the vLLM sampler was closed"))
                self._run(engine, *command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 -- a broken engine: every caller hears of it
                    return self._shutdown(ArcticRLError(f"vLLM's engine step failed ({type(err).__name__}: {err})"))
                for output in outputs:
                    self._take(output)

    def _shutdown(self, err: Exception) -> None:
        """The loop ends: calls in flight and commands not yet run fail with `err`; later ones are refused."""
        with self._lock:
            self._closed = True
        for request_id, call in list(self._calls.items()):
            del self._calls[request_id]
            if not call.future.done():
                call.future.set_exception(err)
        while True:
            try:
                _, _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None and not done.done():
                done.set_exception(err)

    def _run(self, engine, kind: str, payload, done: Future) -> None:
        if kind == "call":
            fn, args, kwargs = payload
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 -- raised in the caller's thread
                done.set_exception(err)
        elif kind == "add":
            self._add(engine, *payload, done)
        elif kind == "abort":
            self._abort(engine)
            done.set_result(None)

    def _add(self, engine, prompts: list[dict], params, done: Future) -> None:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        call = _Call({}, done, set())
        added = []
        try:
            for prompt in prompts:
                request_id = f"arctic-{next(self._ids)}"
                engine.add_request(request_id, prompt, params)
                added.append(request_id)
                call.results[request_id] = PromptResult([Sample() for _ in range(params.n)])
        except Exception as err:  # noqa: BLE001 -- a request vLLM refuses: none of the call's stays in the engine
            engine.abort_request(added)
            done.set_exception(err)
            return
        call.unfinished.update(added)
        for request_id in added:
            self._calls[request_id] = call

    def _take(self, output) -> None:
        call = self._calls.get(output.request_id)
        if call is None:  # a request aborted since
            return
        result = call.results[output.request_id]
        if result.prompt_logprobs is None and output.prompt_logprobs is not None:
            result.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            sample = result.samples[delta.index]
            sample.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                sample.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                sample.finish_reason = delta.finish_reason
        if output.finished:
            self._finish(output.request_id)

    def _finish(self, request_id: str) -> None:
        call = self._calls.pop(request_id)
        call.unfinished.discard(request_id)
        if not call.unfinished and not call.future.done():
            call.future.set_result(list(call.results.values()))

    def _abort(self, engine) -> None:
        request_ids = list(self._calls)
        if request_ids:
            engine.abort_request(request_ids)
        for request_id in request_ids:
            for sample in self._calls[request_id].results[request_id].samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
            self._finish(request_id)
