"""One thread drives vLLM's engine for every caller: requests join the running batch between two engine steps.

vLLM's offline engine (`LLMEngine`) is continuously batched inside, but not thread-safe: driven one call at a
time, a short request sent while a long call runs waits for that whole call. Here a single thread owns the
engine (it builds it, steps it, and runs every other use of it: weight loads, cache resets, RPCs to the
workers), and callers from any thread hand it requests. A request is added at the next step boundary and its
caller is answered as soon as its own samples finish. Where the engine's core runs in a process of its own, the
loop waits at that boundary for the core's next outputs; a caller's request or call ends that wait (an empty output
in their queue), so it reaches the core during the core's step in progress, not after it. Outputs come as deltas
(vLLM's `RequestOutputKind.DELTA`), so what a request sampled so far is known at every step: an abort returns it,
with its log-probs.

A weight update crosses the requests in flight (`held`): at a step boundary each one is ended in the engine,
keeping what it sampled; the weights change while nothing steps; then each sample goes on as a new request whose
prompt is its prompt and what it sampled so far, so its next tokens are sampled from KV computed afresh under the
new weights (never the old weights' cache), and every token records the version that sampled it. (A caller whose
work must see one version, as scoring, keeps weight updates out itself.)
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.samplers.vllm_routed_experts import CONTINUES


@dataclass
class Sample:
    """One of a prompt's n samples, as far as it got."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    """vLLM's log-probs per sampled position (token id -> Logprob)."""
    versions: list[int] = field(default_factory=list)
    """Per sampled token, the weight version that sampled it."""
    finish_reason: str | None = None
    """vLLM's (`stop`, `length`), or `abort`; None while it runs."""
    spans: list[tuple[str, int]] = field(default_factory=list)
    """The engine requests that sampled it, in order: (vLLM's request id, index of the first token it sampled). More
    than one where weight updates cut it."""


@dataclass
class PromptResult:
    samples: list[Sample]
    prompt_logprobs: list | None = None


@dataclass
class _Call:
    """One caller's prompts, answered when every sample of every prompt has finished."""

    results: list[PromptResult]
    future: Future
    on_tokens: Callable | None = None
    """Called on the loop's thread with (prompt index, sample index, new token ids, their log-prob dicts)."""
    unfinished: int = 0
    """Samples not finished."""


@dataclass
class _Request:
    """One engine request: a prompt's n samples, or one sample's continuation after a weight update."""

    call: _Call
    prompt_index: int
    prompt_ids: list[int]
    params: Any
    samples: list[Sample]
    """By vLLM's output index."""
    sample_indexes: list[int]
    """Each sample's index among its prompt's n."""
    lora: Any = None
    """vLLM's `LoRARequest` the request samples with (None: the model alone)."""

    @property
    def result(self) -> PromptResult:
        return self.call.results[self.prompt_index]


class EngineLoop:
    def __init__(self, build: Callable[[], Any], name: str = "arctic-rl-vllm-engine"):
        """`build()` makes vLLM's `LLM` on the loop's thread, which then owns it."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # a command is either run or refused, never left unanswered
        self.version = 0
        """The weight version the engine samples with (tokens are labelled with it as they arrive)."""
        self._holds = 0
        self._suspended: list[tuple[_Request, int]] = []  # cut samples (request, index among its samples)
        self._deferred: list[tuple] = []  # calls submitted while held: added at the release
        self._core_outputs: queue.Queue | None = None
        """The engine core's output queue, where that core is a process of its own (vLLM's `SyncMPClient`)."""
        self._settle = False
        """Requests were aborted: step once more, though none is left."""
        self.routes_continuations = False
        """R3 is recorded: a cut sample's continuation is routed by its record up to the cut (`vllm_routed_experts`)."""
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

    def submit(self, prompts: list[dict], params, on_tokens: Callable | None = None, lora=None) -> Future:
        """Requests (vLLM token prompts, one `SamplingParams` for all, one `LoRARequest` or none) joining the running
        batch; the future resolves to a `PromptResult` per prompt once every sample of every prompt has finished or
        was aborted. `on_tokens(prompt index, sample index, token ids, log-probs)` hears of each step's new tokens
        (on the loop's thread: it must return at once)."""
        done: Future = Future()
        self._put(("add", (prompts, params, on_tokens, lora), done))
        return done

    def cancel(self, call: Future) -> None:
        """End the requests of one call (the future `submit` returned) at the next step boundary: it returns what its
        samples reached, unfinished ones `abort`; other calls go on. From any thread, without waiting (a client's
        disconnect is heard on the server's event loop). A call already answered, or a loop that has stopped, is
        left as it is."""
        with self._lock:
            if not self._closed:
                self._commands.put(("cancel", call, None))
                self._wake()

    def abort_all(self) -> None:
        """End every request in flight: each call returns what its samples reached, unfinished ones `abort`."""
        done: Future = Future()
        self._put(("abort", None, done))
        done.result()

    def hold(self) -> None:
        """From here nothing samples: requests in flight are cut at a step boundary, calls that arrive wait.
        Holds nest; the last `release` ends them."""
        self.call(self._hold)

    def release(self, version: int | None = None) -> None:
        """End a hold; the version becomes `version` (if given). Once no hold is left, every cut sample goes on
        from what it sampled, re-read under the weights then held, and the calls that waited join."""
        self.call(self._release, version)

    @contextmanager
    def held(self, version: int | None = None):
        """`hold`, then `release(version)`: a weight update crossing the requests in flight."""
        self.hold()
        try:
            yield
        finally:
            self.release(version)

    def cut_samples(self) -> list[Sample]:
        """The samples a hold cut, waiting to go on (copies, as they stand)."""
        return self.call(lambda: [Sample(list(r.samples[i].token_ids), versions=list(r.samples[i].versions))
                                  for r, i in self._suspended])

    def samples_in_flight(self) -> list[int]:
        """How many tokens each unfinished sample in the running batch has so far."""
        return self.call(lambda: [len(s.token_ids) for r in self._requests.values() for s in r.samples
                                  if s.finish_reason is None])

    @property
    def in_flight(self) -> int:
        """Requests (prompts, or cut samples going on) the engine is running for callers."""
        return len(self._requests) + len(self._suspended)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._commands.put(("stop", None, None))
            self._wake()
        self._thread.join(timeout=60)

    def _put(self, command) -> None:
        with self._lock:
            if self._closed:
                raise ArcticRLError("the vLLM sampler's engine loop has stopped")
            self._commands.put(command)
            self._wake()

    def _wake(self) -> None:
        """End the loop's wait for the core's next outputs, where the core is a process of its own: `step()` takes an
        empty output, which changes nothing, and the loop then runs the commands waiting. Every command wakes it: one
        that finds the loop idle leaves an empty output its next step takes at once, which costs less than telling
        the two cases apart without a race."""
        if self._core_outputs is None:  # the core runs in this process: `step()` computes, it never waits
            return
        from vllm.v1.engine import EngineCoreOutputs

        self._core_outputs.put_nowait(EngineCoreOutputs())

    # -- the engine's thread ---------------------------------------------------------------------------

    def _main(self, build, built: Future) -> None:
        try:
            llm = build()
        except BaseException as err:  # noqa: BLE001 -- the constructor's caller raises it
            built.set_exception(err)
            return self._shutdown(ArcticRLError("the vLLM sampler failed to start"))
        self._engine = engine = llm.llm_engine
        self._core_outputs = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
        built.set_result(llm)
        while True:
            # Idle (or held): wait for work. Running: take whatever arrived, then one engine step.
            try:
                command = self._commands.get(block=not self._stepping(engine))
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
            if self._stepping(engine):
                self._settle = False
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 -- a broken engine: every caller hears of it
                    return self._shutdown(ArcticRLError(f"vLLM's engine step failed ({type(err).__name__}: {err})"))
                for output in outputs:
                    self._take(output)

    def _stepping(self, engine) -> bool:
        """Whether the loop steps (else it waits for a command). A core in a process of its own is always waited on,
        as `vllm serve` waits on it: what it sends once requests ended (an aborted request's batch freed, and the
        stats of that step, which vLLM's gauges read) is taken when it comes, and a command's wake-up ends the wait.
        A core in this process steps only when asked: one step more after an abort frees the batch and records those
        stats."""
        return engine.has_unfinished_requests() or self._settle or self._core_outputs is not None

    def _shutdown(self, err: Exception) -> None:
        """The loop ends: calls in flight and commands not yet run fail with `err`; later ones are refused."""
        with self._lock:
            self._closed = True
        futures = [r.call.future for r in self._requests.values()] + [r.call.future for r, _ in self._suspended]
        futures += [done for *_, done in self._deferred]
        for future in futures:
            if not future.done():
                future.set_exception(err)
        self._requests.clear()
        self._suspended.clear()
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
            if self._holds:
                self._deferred.append((*payload, done))
            else:
                self._add(engine, *payload, done)
        elif kind == "abort":
            self._abort(engine)
            done.set_result(None)
        elif kind == "cancel":
            self._cancel(engine, payload)

    def _add(self, engine, prompts: list[dict], params, on_tokens: Callable | None, lora, done: Future) -> None:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        call = _Call([PromptResult([Sample() for _ in range(params.n)]) for _ in prompts], done, on_tokens)
        requests = {}
        try:
            for index, (prompt, result) in enumerate(zip(prompts, call.results)):
                request_id = f"arctic-{next(self._ids)}"
                engine_id = engine.add_request(request_id, prompt, params, lora_request=lora)
                requests[request_id] = _Request(call, index, list(prompt["prompt_token_ids"]), params, result.samples,
                                                list(range(params.n)), lora)
                for i, sample in enumerate(result.samples):  # vLLM's ids of a request's n samples (`ParentRequest`)
                    sample.spans.append((engine_id if params.n == 1 else f"{i}_{engine_id}", 0))
        except Exception as err:  # noqa: BLE001 -- a request vLLM refuses: none of the call's stays in the engine
            engine.abort_request(list(requests))
            done.set_exception(err)
            return
        call.unfinished = len(prompts) * params.n
        self._requests.update(requests)

    def _take(self, output) -> None:
        request = self._requests.get(output.request_id)
        if request is None:  # a request aborted since
            return
        if request.result.prompt_logprobs is None and output.prompt_logprobs is not None:
            request.result.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            sample = request.samples[delta.index]
            sample.token_ids.extend(delta.token_ids)
            sample.versions.extend([self.version] * len(delta.token_ids))
            if delta.logprobs is not None:
                sample.logprobs.extend(delta.logprobs)
            if request.call.on_tokens is not None and delta.token_ids:
                request.call.on_tokens(request.prompt_index, request.sample_indexes[delta.index], list(delta.token_ids),
                                       delta.logprobs)
            if delta.finish_reason is not None:
                self._finish(request.call, sample, delta.finish_reason)
        if output.finished:
            del self._requests[output.request_id]

    def _finish(self, call: _Call, sample: Sample, reason: str) -> None:
        if sample.finish_reason is not None:
            return
        sample.finish_reason = reason
        call.unfinished -= 1
        if not call.unfinished and not call.future.done():
            call.future.set_result(call.results)

    def _abort(self, engine) -> None:
        if self._requests:
            engine.abort_request(list(self._requests))
            self._settle = True
        cut = [(r.call, s) for r in self._requests.values() for s in r.samples]
        cut += [(r.call, r.samples[i]) for r, i in self._suspended]
        self._requests.clear()
        self._suspended.clear()
        for call, sample in cut:
            self._finish(call, sample, "abort")

    def _cancel(self, engine, future: Future) -> None:
        ended = [request_id for request_id, r in self._requests.items() if r.call.future is future]
        if ended:
            engine.abort_request(ended)
            self._settle = True
        cut = [(r.call, s) for r in map(self._requests.pop, ended) for s in r.samples]
        cut += [(r.call, r.samples[i]) for r, i in self._suspended if r.call.future is future]
        self._suspended = [(r, i) for r, i in self._suspended if r.call.future is not future]
        for call, sample in cut:
            self._finish(call, sample, "abort")
        waiting = [entry for entry in self._deferred if entry[-1] is future]  # submitted during a hold: never added
        self._deferred = [entry for entry in self._deferred if entry[-1] is not future]
        for prompts, params, _, _, done in waiting:
            done.set_result([PromptResult([Sample(finish_reason="abort") for _ in range(params.n)]) for _ in prompts])

    # -- weight updates across requests in flight --------------------------------------------------------

    def _hold(self) -> None:
        self._holds += 1
        if self._requests:
            # Outputs still on their way for these (an engine core in its own process runs ahead) are dropped
            # by vLLM: what a sample keeps is what arrived before the weights change.
            self._engine.abort_request(list(self._requests))
            self._settle = True
        for request in self._requests.values():
            self._suspended += [(request, i) for i, s in enumerate(request.samples) if s.finish_reason is None]
        self._requests.clear()

    def _release(self, version: int | None) -> None:
        self._holds -= 1
        if version is not None:
            self.version = version
        if self._holds:
            return
        engine = self._engine
        suspended, self._suspended = self._suspended, []
        for request, index in suspended:
            self._go_on(engine, request, index)
        deferred, self._deferred = self._deferred, []
        for prompts, params, on_tokens, lora, done in deferred:
            self._add(engine, prompts, params, on_tokens, lora, done)

    def _go_on(self, engine, request: _Request, index: int) -> None:
        """A cut sample continues as a request of its own: prompt + what it sampled, the rest of its budget."""
        sample = request.samples[index]
        params = request.params.clone()
        done_tokens = len(sample.token_ids)
        params.max_tokens = request.params.max_tokens - done_tokens
        if params.max_tokens <= 0:
            return self._finish(request.call, sample, "length")
        params.n = 1
        params.min_tokens = max(0, request.params.min_tokens - done_tokens)
        params.prompt_logprobs = None
        if params.seed is not None:  # not the draws its first tokens took again
            params.seed = (params.seed + done_tokens) % 2**63
        if self.routes_continuations:  # computed again from its record's routing, never from another's cached KV
            params.extra_args = {**(params.extra_args or {}), CONTINUES: {
                "prompt": len(request.prompt_ids), "sampled": done_tokens, "spans": [list(s) for s in sample.spans]}}
            params.skip_reading_prefix_cache = True
        request_id = f"arctic-{next(self._ids)}"
        try:
            engine_id = engine.add_request(request_id, {"prompt_token_ids": request.prompt_ids + sample.token_ids},
                                           params, lora_request=request.lora)
        except Exception:  # noqa: BLE001 -- it cannot go on: it ends with what it has
            return self._finish(request.call, sample, "abort")
        sample.spans.append((engine_id, done_tokens))
        self._requests[request_id] = _Request(request.call, request.prompt_index, request.prompt_ids, request.params,
                                              [sample], [request.sample_indexes[index]], request.lora)
