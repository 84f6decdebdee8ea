"""The OpenAI- and vLLM-compatible routes, on the job's own sampler, weights and episode capture.

- `/v1/completions`, `/v1/chat/completions` (OpenAI's schema, vLLM's extensions: `return_token_ids`,
  `return_tokens_as_token_ids`, `prompt_logprobs`), streamed as server-sent events on request;
- `/inference/v1/generate`: vLLM 0.32's token-in, token-out route (SkyRL's and PrimeRL's rollouts);
- `/v1/models`, `/health`, `/metrics` (the engines' Prometheus metrics, vLLM's names), and the RL control
  routes `/pause`, `/resume`, `/is_paused`, `/update_weights` (the job's `sync_weights`), `/weight_info`,
  `/get_world_size`.

Every completion reports the weight version that sampled it as vLLM's `weight_versions` spans. A request
naming a session (`session_id`, or the `X-Session-Id` header) records its prompt's token ids and its
completions as turns of that episode, which the training API's `episode` call returns.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
from importlib import metadata
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.errors import ArcticRLError, InvalidRequest, NotFound
from arctic_rl_core.samplers.engine_metrics import served_as
from arctic_rl_core.serving.coalesce import Coalescer
from arctic_rl_core.serving.constraints import check_tools, forced_calls, tool_schema
from arctic_rl_core.serving.handoff import Handoff
from arctic_rl_core.serving.pause import Aborted, ClientGone, PauseGate, PauseMode
from arctic_rl_core.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenGenerateRequest,
    TokenizeRequest,
    parse_request,
)
from arctic_rl_core.serving.text import StreamedText, TextCodec
from arctic_rl_core.serving.tool_calls import ToolCallStream, ToolCalls, as_rendered, parser_class
from arctic_rl_core.types import SESSION_ID_CHARS, Completion, GenerateRequest, SamplingParams

SESSION_HEADER = "x-session-id"


class ModelNotFound(NotFound):
    """The request names a model this server does not serve (HTTP 404)."""


@dataclass
class Sampled:
    """One request's completions, or None for each prompt's choices if it was aborted."""

    prompts: list[list[int]]
    completions: list[Completion] | None
    n: int

    @property
    def usage(self) -> dict:
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.token_ids) for c in self.completions or [])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def choices(self) -> list[tuple[int, Completion | None]]:
        """(choice index, completion) in OpenAI's order: prompt by prompt, n each."""
        if self.completions is None:
            return [(i, None) for i in range(len(self.prompts) * self.n)]
        return list(enumerate(self.completions))


def _routed_experts(c: Completion, start: int) -> dict:
    """A completion's routing (R3) as prime-rl's and SkyRL's inference servers return it on a choice, which their
    clients read: `[tokens, layers, top_k]` from `start` (`routed_experts_prompt_start`) to the last forwarded token,
    raw in base64, in the narrowest type that holds the ids (uint8, int16, int32: SkyRL refuses any other), `data`
    first (SkyRL's client finds it by scanning the compact JSON). vLLM's own `.npy` string is not sent."""
    routes = c.routed_experts.array()[start:]
    top = int(routes.max()) if routes.size else 0
    compact = routes.astype(np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32)
    return {"data": base64.b64encode(np.ascontiguousarray(compact).tobytes()).decode("ascii"),
            "shape": list(compact.shape), "start": start, "dtype": compact.dtype.name}


def _joined(first: tuple | None, then: tuple) -> tuple:
    """Two stream pieces (text, token ids, log-probs, top log-probs, ranks) as one."""
    if first is None:
        return then
    return tuple(a + b if a is not None and b is not None else None for a, b in zip(first, then))


def _check_routes_start(start: int | None, prompt: list[int], field_: str) -> None:
    if start is not None and not 0 <= start <= len(prompt):
        raise InvalidRequest(field_, f"is {start}; it must be within the prompt (0 to {len(prompt)})")


def _routes_from(c: Completion, start: int | None) -> dict:
    """A token route's choice's `routed_experts` (vLLM's key) as prime-rl's and SkyRL's servers send it, where the
    sampler recorded them (router replay's R3)."""
    return {} if c.routed_experts is None else {"routed_experts": _routed_experts(c, start or 0)}


def _routes_as_vllm(c: Completion, start: int | None) -> dict:
    """An OpenAI route's choice's `routed_experts` as `vllm serve` sends it: base64 of the `[tokens, layers, top_k]`
    array's `.npy` bytes (`np.load(io.BytesIO(base64.b64decode(s)))`), uint8 up to 256 experts, else uint16."""
    if c.routed_experts is None:
        return {}
    routes = c.routed_experts.array()[start or 0:]
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if routes.size == 0 or routes.max() < 2**8 else np.uint16),
            allow_pickle=False)
    return {"routed_experts": base64.b64encode(buffer.getbuffer()).decode("ascii")}


def _content_text(message: dict) -> str:
    """A message's text: its content, or its text parts joined by newlines (vLLM's echo)."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content or ""


def _spans(c: Completion) -> list[dict]:
    """vLLM's weight-version spans: which version sampled tokens [start, end) (several where a sync crossed it)."""
    versions = c.token_versions or [c.weight_version] * len(c.token_ids)
    spans = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans or [{"version": str(c.weight_version), "start": 0, "end": 0}]


@dataclass
class Serving:
    """The serving surface's state on one server."""

    served_model_name: str | None
    tool_call_parser: str | None = None
    """A vLLM tool parser's name (`hermes`, ...): chat replies to requests with `tools` are read into the message's
    `tool_calls` by it, and constrained to its format as `vllm serve` constrains them (`serving.tool_calls`)."""
    gate: PauseGate = field(default_factory=PauseGate)
    frozen: Any = None
    """The job whose sampler `/pause?mode=keep` froze, until `/resume`."""
    requests: dict[str, int] = field(default_factory=lambda: {"completions": 0, "chat": 0, "generate": 0})
    cancelled: int = 0
    """Requests whose client went away before their answer: each was ended in the sampler where it can."""
    max_concurrent: int = 64
    """Requests sampling at once on a continuously batched sampler (the server's connection cap)."""
    _codec: tuple[Any, TextCodec] | None = None
    _tool_parser: tuple[TextCodec, type] | None = None
    _coalescer: tuple[Any, Coalescer] | None = None
    _callers: ThreadPoolExecutor | None = None
    _direct_calls: int = 0
    _handoff: Handoff | None = None

    def handoff(self) -> Handoff:
        """The running event loop's: streams' tokens from the engine's thread."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = Handoff(loop)
        return self._handoff

    def codec(self, api) -> TextCodec:
        if self._codec is None or self._codec[0] is not api:
            self._codec = (api, TextCodec(api.config.model_path))
        return self._codec[1]

    def tool_calls(self, api, req: ChatCompletionRequest) -> ToolCalls | None:
        """The request's tool calling through the server's parser; None without a parser, tools, or where tools are
        not to be called."""
        if self.tool_call_parser is None or not req.tools or req.tool_choice == "none":
            return None
        codec = self.codec(api)
        if self._tool_parser is None or self._tool_parser[0] is not codec:
            self._tool_parser = (codec, parser_class(self.tool_call_parser, codec.tokenizer))
        return ToolCalls(self._tool_parser[1], codec.tokenizer, req)

    def generate(self, api, executor, prompts: list[list[int]], sampling: SamplingParams,
                 on_tokens: Callable | None = None, cancel: Cancellation | None = None) -> Awaitable[list[Completion]]:
        """A sampler that batches continuously (vLLM's engine, a pool of them) takes each request as its own call, at
        once: it joins the running batch (and tells `on_tokens` of each step's tokens where the sampler streams them),
        and where it can, ends it once `cancel` is cancelled. Others take the calls the coalescer gathers."""
        if not api.sampler.continuous_batching:
            return self.coalescer(api, executor).generate(prompts, sampling)
        if self._callers is None:
            self._callers = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="arctic-sample")
        self._direct_calls += 1
        return asyncio.wrap_future(self._callers.submit(api.generate, prompts, sampling, None, on_tokens, cancel))

    def coalescer(self, api, executor) -> Coalescer:
        """The job's sampler takes concurrent requests as one call; a pool of replicas takes several calls."""
        if self._coalescer is None or self._coalescer[0] is not api:
            def generate(prompts, sampling):
                return asyncio.wrap_future(executor.submit(api.generate, prompts, sampling))
            self._coalescer = (api, Coalescer(generate, max_in_flight=2 * api.config.sampler.replicas
                                              if api.sampler.concurrent_generate else 1))
        return self._coalescer[1]

    def model_name(self, api) -> str:
        return self.served_model_name or api.config.model_path

    def describe(self) -> dict:
        return {"requests": dict(self.requests), "cancelled": self.cancelled, **self.gate.describe(),
                "generate_calls": self._direct_calls + (self._coalescer[1].calls if self._coalescer else 0)}


def add_serving_routes(app: FastAPI, serving: Serving, job, api_of: Callable[[], Any],
                       read_json: Callable[[Request], Awaitable[Any]], limits, run_in) -> None:
    """`api_of()` is the job's training API (or the server's error for no job); `read_json` reads a request's
    body within the server's caps; `run_in(executor, fn)` runs training-state work on the job's ordered worker."""

    def check_model(api, name: str | None) -> str:
        served = serving.model_name(api)
        if name is not None and name != served:
            raise ModelNotFound("model", f"the model {name!r} does not exist; this server serves {served!r}")
        return served

    def session_of(request: Request, body_session: str | None) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if body_session is None and header is not None:
            if not 0 < len(header) <= SESSION_ID_CHARS:
                raise InvalidRequest(SESSION_HEADER, f"must be 1 to {SESSION_ID_CHARS} characters")
            return header
        return body_session

    def max_tokens(api, requested: int | None, prompts: list[list[int]]) -> int:
        """What was asked, or (chat, token route) the rest of the context within the server's cap."""
        if requested is not None:
            return requested
        room = api.sampler.max_context - max(map(len, prompts))
        if room < 1:
            raise InvalidRequest("max_tokens", f"the prompt fills the model's context ({api.sampler.max_context} tokens)")
        return min(room, limits.max_tokens)

    def check(api, prompts: list[list[int]], sampling: SamplingParams, fields: Callable[[str], str]) -> None:
        """A bad request is refused on its own (never joining, and failing, a batch), naming the route's fields."""
        try:
            limits.check("generate", GenerateRequest(prompts=prompts, sampling=sampling))
            api.checked_generate(prompts, sampling)
        except InvalidRequest as err:
            raise type(err)(fields(err.field), err.message) from None

    async def sample(api, route: str, prompts: list[list[int]], sampling: SamplingParams, session: str | None,
                     fields: Callable[[str], str], request: Request, on_tokens: Callable | None = None,
                     cancel: Cancellation | None = None) -> Sampled | None:
        """Generate on the job's sampler (one pool, one weight version with `generate`); capture if asked.
        Errors name the route's own fields. `on_tokens`: as `generate`'s, on a continuously batched sampler.

        A client that disconnects before its answer (a turn's timeout, an agent ending early) cancels the call: the
        sampler ends its requests at its next step, and a session records the turn as cancelled with no tokens,
        which is what the client received; None is returned. With `cancel` the caller watches the client itself
        (a stream) and records what it sent."""
        check(api, prompts, sampling, fields)
        watched = cancel is None
        cancel = cancel or Cancellation()
        try:
            async with serving.gate.admitted() as abort:
                work = asyncio.ensure_future(serving.generate(api, job.reads, prompts, sampling, on_tokens, cancel))
                gone = asyncio.ensure_future(_client_gone(request)) if watched else None
                try:
                    completions = await serving.gate.run(abort, work, gone)
                except Aborted:
                    # A continuously batched sampler answers it with what it sampled so far (the pause ends its
                    # requests in flight); another sampler's call runs on, and its answer is dropped.
                    completions = await work if api.sampler.continuous_batching else None
                except ClientGone:
                    cancel.cancel()
                    serving.cancelled += 1
                    if session is not None:
                        work.add_done_callback(lambda done: record_sent(api, session, prompts, _result(done), {}))
                    return None
                finally:
                    if gone is not None:
                        gone.cancel()
        except InvalidRequest as err:
            raise type(err)(fields(err.field), err.message) from None
        serving.requests[route] += 1
        if session is not None and completions is not None and watched:
            api.trajectories.record(session, prompts, completions)
        return Sampled(prompts, completions, sampling.n)

    def record_sent(api, session: str, prompts: list[list[int]], completions: list[Completion] | None,
                    sent: dict[int, int]) -> None:
        """A cancelled request's turns as its client received them, marked cancelled: the first `sent[choice]`
        tokens of each choice (none where absent), from the sampler's answer once it ended the call (which may hold
        tokens the client never got)."""
        if completions is None:  # the call failed, or a pause aborted it before it sampled
            return
        api.trajectories.record(session, prompts, [_truncated(c, sent.get(i, 0)) for i, c in enumerate(completions)],
                                cancelled=True)

    async def begin(request: Request, schema):
        """The request parsed, the job's API, and the served model's name (checked against the request's)."""
        req = parse_request(schema, await read_json(request))
        api = api_of()
        return req, api, check_model(api, req.model)

    def streams(req, api, sampling: SamplingParams, logprobs) -> bool:
        """Whether the request's text is sent as the engine samples it (`stream` on a sampler that streams tokens),
        with each piece's log-probs (if `logprobs` asks for them). Whole at the end: prompt log-probs, and the
        model's own log-probs of reshaped sampling (`logprobs_of: model`), which the sampler has by scoring the
        reply again."""
        rescored = sampling.logprobs_of == "model" and sampling.reshaped_by() is not None
        return (bool(req.stream) and api.sampler.streams_tokens and sampling.prompt_logprobs is None
                and not (logprobs is not None and logprobs is not False and rescored))

    def stream_as_sampled(api, route: str, request: Request, prompts: list[list[int]], sampling: SamplingParams,
                          session: str | None, fields: Callable[[str], str], texts: Callable[[int], StreamedText],
                          first: list[dict], piece: Callable[..., dict | None],
                          last: Callable[[Sampled, dict[int, StreamedText]], list[dict]], usage_head: dict | None,
                          interval: int | None = None):
        """Server-sent events while the engine samples: `first`, then `piece(choice, text, token ids, their log-probs,
        their top log-probs, their ranks)` as each choice's tokens arrive (text that may be shown: `texts(choice)`; a
        None piece sends nothing yet), then `last(sampled, texts)`, usage with `usage_head`. `interval` (vLLM's
        `stream_interval`): a choice's first piece at once, then pieces of that many tokens. The request is checked before the response starts: a bad one is an HTTP error.

        A client that disconnects mid-stream (Starlette then cancels these events) cancels the call in the sampler;
        a session records each choice's tokens up to the last piece the client was sent, marked cancelled."""
        check(api, prompts, sampling, fields)
        interval = interval or 1
        handoff = serving.handoff()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = Cancellation()

        def on_tokens(prompt: int, sample: int, token_ids: list[int], logprobs: list[float], tops, ranks) -> None:
            # on the engine's thread: handed to the event loop
            handoff.put(pieces, (prompt * sampling.n + sample, token_ids, logprobs, tops, ranks))

        work = asyncio.ensure_future(sample(api, route, prompts, sampling, session, fields, request, on_tokens, cancel))
        work.add_done_callback(lambda _: handoff.put(pieces, None))  # after every piece

        async def events():
            text_of: dict[int, StreamedText] = {}
            sent: dict[int, int] = {}
            """Per choice, the tokens of the pieces the client was sent (a `yield` returns once Starlette sent it)."""
            held: dict[int, int] = {}
            """Per choice, the tokens since, not yet sent."""
            pending: dict[int, tuple] = {}
            """Per choice, the pieces not yet made into an event (`interval`)."""
            ended = False
            try:
                for event in first:
                    yield f"data: {json.dumps(event)}\n\n"
                while (item := await pieces.get()) is not None:
                    choice, token_ids, logprobs, tops, ranks = item
                    text = text_of.setdefault(choice, texts(choice)).add(token_ids)
                    held[choice] = held.get(choice, 0) + len(token_ids)
                    if interval > 1:  # after a choice's first piece, pieces of `interval` tokens
                        joined = _joined(pending.pop(choice, None), (text, token_ids, logprobs, tops, ranks))
                        if choice in sent and len(joined[1]) < interval:
                            pending[choice] = joined
                            continue
                        text, token_ids, logprobs, tops, ranks = joined
                    if (event := piece(choice, text, token_ids, logprobs, tops, ranks)) is None:
                        continue  # nothing to show yet: these tokens go with the next piece sent
                    yield f"data: {json.dumps(event)}\n\n"
                    sent[choice] = sent.get(choice, 0) + held.pop(choice)
                for choice, rest in pending.items():  # the tokens short of an interval at the end
                    if (event := piece(choice, *rest)) is not None:
                        yield f"data: {json.dumps(event)}\n\n"
                        sent[choice] = sent.get(choice, 0) + held.pop(choice)
                ended = True
                try:
                    sampled = work.result()
                except ArcticRLError as err:  # the stream has begun: the error is its last event
                    yield f"data: {json.dumps({'error': {'message': str(err), 'type': type(err).__name__}})}\n\n"
                    return
                if session is not None and sampled.completions is not None:
                    api.trajectories.record(session, prompts, sampled.completions)
                for event in last(sampled, text_of) + ([{**usage_head, "choices": [], "usage": sampled.usage}]
                                                       if usage_head else []):
                    yield f"data: {json.dumps(event)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not ended:  # the client went away before the sampler ended the call
                    cancel.cancel()
                    serving.cancelled += 1
                    if session is not None:
                        work.add_done_callback(lambda done: record_sent(
                            api, session, prompts, getattr(_result(done), "completions", None), sent))
        return StreamingResponse(events(), media_type="text/event-stream")

    def respond(req, payload: dict, chunks: Callable[[dict], list[dict]], head: dict):
        """JSON, or with `stream` server-sent events: `chunks`, then usage if asked (in a chunk with `head`)."""
        if not req.stream:
            return JSONResponse(payload)
        events = chunks(payload)
        if req.stream_options and req.stream_options.include_usage:
            events.append({**head, "choices": [], "usage": payload["usage"]})

        async def stream():
            for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- models and health -------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        api_of()
        return JSONResponse({})

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        """vLLM's (and SageMaker's) health check by another name."""
        api_of()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        """The vLLM version that samples, as `vllm serve` answers (clients check it); Arctic RL's beside it."""
        return {"version": _engine_version(), "arctic_rl": _version("arctic-rl")}

    @app.get("/metrics")
    async def metrics():
        """The sampler's engine metrics in Prometheus' text format, under vLLM's names (`vllm:num_requests_running`,
        `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`, ...), one `engine` label per replica."""
        api = api_of()
        exposition = served_as(await asyncio.to_thread(api.sampler.engine_metrics), serving.model_name(api))
        return PlainTextResponse(exposition, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        api = api_of()
        return {"object": "list", "data": [{
            "id": serving.model_name(api), "object": "model", "created": int(time.time()), "owned_by": "arctic-rl",
            "root": api.config.model_path, "max_model_len": api.sampler.max_context}]}

    # -- OpenAI completions ------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, api, model = await begin(request, CompletionRequest)
        codec = serving.codec(api)
        prompt = req.prompt
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequest("prompt", "must hold at least one prompt")
        prompts = [req.truncated(p if isinstance(p, list) else codec.encode(p, req.add_special_tokens, "prompt"),
                                 api.sampler.max_context, True) for p in prompt]
        for p in prompts:
            _check_routes_start(req.routed_experts_prompt_start, p, "routed_experts_prompt_start")
        many = len(prompts) > 1
        session = session_of(request, req.session_id)
        fields = lambda f: _renamed(f, "prompt", many, constraint=_constraint_field(req, False))  # noqa: E731
        # vLLM's echo: each choice's text after its prompt's; with logprobs, the prompt's log-probs before the
        # reply's. With max_tokens 0 the prompt alone comes back (one token is sampled and not shown).
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens", "must be at least 1 (0 only with echo)")
        if req.max_tokens == 0 and session is not None:
            raise InvalidRequest("max_tokens", "0 samples nothing to record in a session")
        prompt_only = req.max_tokens == 0
        sampling = req.sampling(1 if prompt_only else req.max_tokens or 16, req.logprobs or 0)
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            sampling = sampling.model_copy(update={"prompt_logprobs": req.logprobs})
        echoes = ["" if req.return_token_ids else p if isinstance(p, str) and req.truncate_prompt_tokens is None
                  else codec.decode(ids, req.skip_special_tokens)
                  for p, ids in zip(prompt, prompts)] if req.echo else None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": _fingerprint(api)}

        def choices_of(sampled: Sampled, echoed: bool = True) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                prompt_ids = prompts[index // req.n]
                if c is None:
                    choices.append({"index": index, "text": "", "logprobs": None, "finish_reason": "abort",
                                    "stop_reason": None, "token_ids": [] if req.return_token_ids else None})
                    continue
                text, stop_reason = codec.finished_text(c, req.stops(), req.stop_token_ids or [],
                                                        req.include_stop_str_in_output, req.skip_special_tokens)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = _completion_logprobs(codec, c.token_ids, c.logprobs, c.top_logprobs,
                                                    req.return_tokens_as_token_ids)
                if echoes is not None and echoed:
                    echo = echoes[index // req.n]
                    text = echo if prompt_only else echo + text
                    if logprobs is not None:
                        logprobs = _echoed_logprobs(codec, prompt_ids, c, req.return_tokens_as_token_ids,
                                                    None if prompt_only else logprobs)
                choices.append({
                    "index": index, "text": text, "finish_reason": c.finish_reason, "stop_reason": stop_reason,
                    "logprobs": logprobs,
                    "token_ids": c.token_ids if req.return_token_ids else None,
                    "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                    "prompt_logprobs": _prompt_logprobs(codec, c, prompt_ids),
                    "weight_versions": _spans(c), **_routes_as_vllm(c, req.routed_experts_prompt_start)})
            return choices

        usage_head = head if req.stream_options and req.stream_options.include_usage else None
        if streams(req, api, sampling, req.logprobs):
            text_at: dict[int, int] = {}  # per choice, where the next piece's text starts (its log-probs' offsets)

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, _ranks) -> dict:
                entries = None
                if req.logprobs is not None:
                    entries = _completion_logprobs(codec, token_ids, logprobs, tops, req.return_tokens_as_token_ids,
                                                   text_at.get(index, 0))
                    text_at[index] = text_at.get(index, 0) + sum(len(codec.token_text(t, False)) for t in token_ids)
                return {**head, "choices": [{"index": index, "text": text, "logprobs": entries, "finish_reason": None,
                                             "stop_reason": None, **({"token_ids": token_ids} if req.return_token_ids else {})}]}

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                return [{**head, "choices": [{**choice, "token_ids": None, "logprobs": None,
                                              "text": sent[choice["index"]].rest(choice["text"])
                                              if choice["index"] in sent else choice["text"]}]}
                        for choice in choices_of(sampled, echoed=False)]  # the echo went first
            first = [{**head, "choices": [{"index": i, "text": echoes[i // req.n], "logprobs": None,
                                           "finish_reason": None, "stop_reason": None}]}
                     for i in range(len(prompts) * req.n)] if echoes is not None else []
            return stream_as_sampled(api, "completions", request, prompts, sampling, session, fields,
                                     lambda _: StreamedText(codec, req.stops(), req.skip_special_tokens,
                                                            req.stop_token_ids or [], req.ignore_eos,
                                                            req.include_stop_str_in_output),
                                     first, piece, last, usage_head, req.stream_interval)
        sampled = await sample(api, "completions", prompts, sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        payload = {**head, "choices": choices_of(sampled), "usage": sampled.usage}
        return respond(req, payload, lambda p: [{**head, "choices": [choice]} for choice in p["choices"]], head)

    # -- OpenAI chat completions -------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, api, model = await begin(request, ChatCompletionRequest)
        codec = serving.codec(api)
        if "prompt_token_ids" in (req.kv_transfer_params or {}):
            raise InvalidRequest("kv_transfer_params.prompt_token_ids", "this server has no disaggregated prefill: "
                                                                        "the prompt is the messages' rendering")
        # As vLLM, the tools stay in the prompt under tool_choice "none": the model only must not call them.
        prompt_text = codec.chat_text(req.messages, as_rendered(req.tools), req.add_generation_prompt,
                                      req.template_kwargs(), req.continue_final_message, req.documents)
        budget = req.max_completion_tokens or req.max_tokens
        prompt_ids = req.truncated(codec.encode(prompt_text, False, "messages"), api.sampler.max_context,
                                   budget is not None)
        _check_routes_start(req.routed_experts_prompt_start, prompt_ids, "routed_experts_prompt_start")
        # vLLM's: the reply's role is the last message's where no generation prompt opens an assistant's turn
        reply_role = "assistant" if req.add_generation_prompt else req.messages[-1]["role"]
        echoed = _content_text(req.messages[-1]) if req.echo and req.messages[-1]["role"] == reply_role else ""
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        check_tools(req.tools, req.tool_choice, req.constraint() is not None)
        tools = serving.tool_calls(api, req)  # vLLM's parser, where the server has one
        # Without a parser a forced choice constrains the reply to vLLM's JSON form of calls (`serving.constraints`).
        forced = req.tool_choice if tools is None and (req.tool_choice == "required" or
                                                       isinstance(req.tool_choice, NamedToolChoice)) else None
        calls_schema = tool_schema(req.tools or [], forced, req.parallel_tool_calls)
        constraint = tools.constraint() if tools is not None else \
            None if calls_schema is None else {"json_schema": calls_schema}
        sampling = req.sampling(max_tokens(api, budget, [prompt_ids]), req.top_logprobs or 0, constraint)
        if req.echo and req.prompt_logprobs is None:  # vLLM's echo returns the prompt's log-probs
            sampling = sampling.model_copy(update={"prompt_logprobs": req.top_logprobs or 0})
        session = session_of(request, req.session_id)
        by_tools = forced is not None or tools is not None and (constraint or {}).get("structural_tag") is not None
        fields = lambda f: _renamed(f, "messages", False, constraint=_constraint_field(req, by_tools))  # noqa: E731
        skip_special_tokens = req.skip_special_tokens if tools is None else tools.skip_special_tokens
        created = int(time.time())
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": _fingerprint(api)}

        def text_of(c: Completion) -> tuple[str, Any]:
            """The reply's text and stop reason (with a parser: what the parser reads)."""
            return codec.finished_text(c, req.stops(), req.stop_token_ids or [], req.include_stop_str_in_output,
                                       skip_special_tokens)

        def choices_of(sampled: Sampled) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                if c is None:
                    choices.append({"index": index, "message": {"role": reply_role, "content": ""}, "logprobs": None,
                                    "finish_reason": "abort", "stop_reason": None,
                                    "token_ids": [] if req.return_token_ids else None})
                    continue
                text, stop_reason = text_of(c)
                calls, finish_reason = [], c.finish_reason
                if forced is not None:  # the reply is the calls (vLLM: empty content, a named call ends as "stop")
                    calls, text = forced_calls(text, forced), ""
                    finish_reason = "tool_calls" if forced == "required" and c.finish_reason == "stop" else finish_reason
                elif tools is not None:
                    text, calls, finish_reason = tools.parse(text, c.token_ids, c.finish_reason)
                content = echoed + text if echoed and text is not None else text
                message = {"role": reply_role, "content": content, **({"tool_calls": calls} if calls else {})}
                choices.append({
                    "index": index, "message": message,
                    "logprobs": {"content": _chat_logprobs(codec, c.token_ids, c.logprobs, c.top_logprobs,
                                                           req.return_tokens_as_token_ids)} if req.logprobs else None,
                    "finish_reason": finish_reason, "stop_reason": stop_reason,
                    "token_ids": c.token_ids if req.return_token_ids else None, "weight_versions": _spans(c),
                    **_routes_as_vllm(c, req.routed_experts_prompt_start)})
            return choices

        def role(index: int) -> dict:
            return {**head, "choices": [{"index": index, "delta": {"role": reply_role, "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                    **({"prompt_text": prompt_text} if req.return_prompt_text else {})}

        def ending(choice: dict, content: str | None, token_ids, logprobs) -> list[dict]:
            i = choice["index"]
            delta = {"content": content}
            if "tool_calls" in choice["message"]:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(choice["message"]["tool_calls"])]
            return [{**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": None, "token_ids": token_ids}]},
                    {**head, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                                          "stop_reason": choice["stop_reason"],
                                          "weight_versions": choice.get("weight_versions")}]}]

        usage_head = head if req.stream_options and req.stream_options.include_usage else None
        if streams(req, api, sampling, req.logprobs) and forced is None:
            first = [role(i) for i in range(sampling.n)]
            if req.return_token_ids:
                first[0]["prompt_token_ids"] = prompt_ids
            calls_of: dict[int, ToolCallStream] = {}
            """Per choice, its reply read by the parser as it streams."""

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, _ranks) -> dict | None:
                entries = {"content": _chat_logprobs(codec, token_ids, logprobs, tops, req.return_tokens_as_token_ids)
                           } if req.logprobs else None
                delta: dict | None = {"content": text}
                if tools is not None:
                    delta = calls_of.setdefault(index, tools.stream(prompt_ids)).delta(text, token_ids, finished=False)
                    if delta is None:  # text the parser holds back: a chunk only for the tokens' ids or log-probs
                        if entries is None and not req.return_token_ids:
                            return None
                        delta = {}
                return {**head, "choices": [{"index": index, "delta": delta, "logprobs": entries,
                                             "finish_reason": None,
                                             **({"token_ids": token_ids} if req.return_token_ids else {})}]}

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                if tools is None:
                    return [event for choice in choices_of(sampled) for event in ending(
                        choice, sent[choice["index"]].rest(choice["message"]["content"] or "") if choice["index"] in sent
                        else choice["message"]["content"], None, None)]
                events = []
                for index, c in sampled.choices():  # the text not yet sent goes through the parser, which ends
                    if c is None:
                        events.append({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                            "finish_reason": "abort", "stop_reason": None}]})
                        continue
                    text, stop_reason = text_of(c)
                    calls = calls_of.setdefault(index, tools.stream(prompt_ids))
                    delta = calls.delta(sent[index].rest(text) if index in sent else text, [], finished=True)
                    events.append({**head, "choices": [{
                        "index": index, "delta": delta or {}, "logprobs": None,
                        "finish_reason": calls.finish_reason(c.finish_reason), "stop_reason": stop_reason,
                        "weight_versions": _spans(c)}]})
                return events
            return stream_as_sampled(api, "chat", request, [prompt_ids], sampling, session, fields,
                                     lambda _: StreamedText(codec, req.stops(), skip_special_tokens,
                                                            req.stop_token_ids or [], req.ignore_eos,
                                                            req.include_stop_str_in_output),
                                     first, piece, last, usage_head, req.stream_interval)
        sampled = await sample(api, "chat", [prompt_ids], sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)
        first = sampled.completions[0] if sampled.completions else None
        payload = {"id": ident, "object": "chat.completion", "created": created, "model": model,
                   "system_fingerprint": head["system_fingerprint"], "choices": choices_of(sampled), "usage": sampled.usage,
                   "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                   "prompt_logprobs": _prompt_logprobs(codec, first, prompt_ids) if first else None,
                   "prompt_text": prompt_text if req.return_prompt_text else None}

        def chunks(p):
            out = [event for choice in p["choices"]
                   for event in [role(choice["index"])] + ending(choice, choice["message"]["content"], choice["token_ids"],
                                                                 choice["logprobs"])]
            if p["prompt_token_ids"] is not None:
                out[0]["prompt_token_ids"] = p["prompt_token_ids"]
            return out
        return respond(req, payload, chunks, head)

    # -- vLLM's token-in, token-out route ----------------------------------------------------------

    @app.post("/inference/v1/generate")
    @app.post("/skyrl/v1/generate")  # SkyRL's client's route where it wants routed experts: the same, routes packed
    async def generate_tokens(request: Request):
        req, api, model = await begin(request, TokenGenerateRequest)
        if req.return_sample_support:
            raise InvalidRequest("return_sample_support", "this server samples from the model's full distribution: no "
                                 "sample support to return (SkyRL's enable_sample_support_replay stays off)")
        if req.output_mode == "text" and not req.sampling_params.detokenize:
            raise InvalidRequest("output_mode", "'text' needs sampling_params.detokenize true")
        sampling = req.sampling(max_tokens(api, req.sampling_params.max_tokens, [req.token_ids]))
        _check_routes_start(req.sampling_params.routed_experts_prompt_start, req.token_ids,
                            "sampling_params.routed_experts_prompt_start")
        session = session_of(request, req.session_id)
        fields = lambda f: _renamed(f, "token_ids", False, sampling_prefix="sampling_params.")  # noqa: E731
        codec = serving.codec(api) if req.output_mode == "text" else None
        params = req.sampling_params
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        request_id = req.request_id or uuid.uuid4().hex
        head = {"request_id": request_id, "output_mode": req.output_mode}

        def entries(token_ids, logprobs, tops, ranks) -> dict | None:
            """vLLM's: `GenerateLogProbs` by token id, or with text the chat shape."""
            if params.logprobs is None:
                return None
            if codec is not None:
                return {"content": _chat_logprobs(codec, token_ids, logprobs, tops, False)}
            return {"content": _token_logprobs(token_ids, logprobs, tops, ranks)}

        def choices_of(sampled: Sampled) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                if c is None:
                    choices.append({"index": index, "finish_reason": "abort", "stop_reason": None, "token_ids": [],
                                    "logprobs": None, **({"text": ""} if codec else {})})
                    continue
                choice = {"index": index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                          "weight_versions": _spans(c), "stop_reason": None,
                          "logprobs": entries(c.token_ids, c.logprobs, c.top_logprobs, c.ranks)}
                choice.update(_routes_from(c, params.routed_experts_prompt_start))
                if codec is not None:
                    choice["text"], choice["stop_reason"] = codec.finished_text(
                        c, stops, params.stop_token_ids or [], params.include_stop_str_in_output,
                        params.skip_special_tokens)
                elif c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in (params.stop_token_ids or []):
                    choice["stop_reason"] = c.token_ids[-1]
                elif c.finish_reason == "repetition":
                    choice["stop_reason"] = "repetition_detected"
                choices.append(choice)
            return choices

        if streams(req, api, sampling, params.logprobs):
            # vLLM's stream: each step's token ids (and text) with their log-probs, then per choice a last chunk
            # with its finish and stop reasons and weight versions; the prompt's ids on the first, if asked.
            unsent_prompt = [req.token_ids] if req.return_token_ids else []

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, ranks) -> dict:
                chunk = {**head, "choices": [{"index": index, "finish_reason": None, "stop_reason": None,
                                              "token_ids": token_ids, "logprobs": entries(token_ids, logprobs, tops, ranks),
                                              **({"text": text} if codec else {})}]}
                if unsent_prompt:
                    chunk["prompt_token_ids"] = unsent_prompt.pop()
                return chunk

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                return [{**head, "choices": [{**choice, "token_ids": [], "logprobs": None, **({"text": (
                    sent[choice["index"]].rest(choice["text"]) if choice["index"] in sent else choice["text"])}
                    if codec else {})}]} for choice in choices_of(sampled)]
            usage_head = head if req.stream_options and req.stream_options.include_usage else None
            return stream_as_sampled(api, "generate", request, [req.token_ids], sampling, session, fields,
                                     lambda _: StreamedText(codec, stops, params.skip_special_tokens,
                                                            params.stop_token_ids or [], params.ignore_eos,
                                                            params.include_stop_str_in_output) if codec else _NO_TEXT,
                                     [], piece, last, usage_head, params.stream_interval)
        sampled = await sample(api, "generate", [req.token_ids], sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)
        first = sampled.completions[0] if sampled.completions else None
        payload = {"request_id": request_id, "model": model, "created": int(time.time()),
                   "output_mode": req.output_mode, "usage": sampled.usage, "prompt_token_ids": req.token_ids,
                   "prompt_logprobs": _vllm_prompt_logprobs(first) if first else None, "choices": choices_of(sampled)}
        return respond(req, payload, lambda p: [
            {**head, "choices": [choice], **({"prompt_token_ids": p["prompt_token_ids"]} if i == 0 and req.return_token_ids else {})}
            for i, choice in enumerate(p["choices"])], head)

    # -- tokenizer ------------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req, api, _ = await begin(request, TokenizeRequest)
        codec = serving.codec(api)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("prompt", "give a prompt or messages, not both")
        if req.messages is not None:
            tokens = codec.render_chat(req.messages, as_rendered(req.tools), req.add_generation_prompt, req.chat_template_kwargs)
            if req.add_special_tokens:
                tokens = codec.encode(codec.decode(tokens, skip_special_tokens=False), True, "messages")
        else:
            tokens = codec.encode(req.prompt, req.add_special_tokens is not False, "prompt")
        return {"count": len(tokens), "max_model_len": api.sampler.max_context, "tokens": tokens,
                "token_strs": [codec.token_text(t, False) for t in tokens] if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req, api, _ = await begin(request, DetokenizeRequest)
        vocab = api.engine.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"tokens[{bad}]", f"token id {req.tokens[bad]} is outside the vocabulary ({vocab})")
        return {"prompt": serving.codec(api).decode(req.tokens, skip_special_tokens=False)}

    # -- RL control ----------------------------------------------------------------------------------

    @app.post("/pause")
    async def pause(mode: PauseMode = Query("abort"), clear_cache: bool = Query(True)):
        await serving.gate.pause(mode)
        if mode == "abort" and job.api is not None:
            # The sampler ends the call in flight too, so a weight sync need not wait for it.
            await asyncio.to_thread(job.api.abort_generation)
        if mode == "keep" and job.api is not None and serving.frozen is None:
            # Requests in flight stop where they are; a weight update before /resume applies to the rest of each.
            api = job.api
            serving.frozen = api if await asyncio.to_thread(api.pause_generation) else None
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        if serving.frozen is not None:
            frozen, serving.frozen = serving.frozen, None
            await asyncio.to_thread(frozen.resume_generation)
        serving.gate.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": serving.gate.paused}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await read_json(request)
        extra = next((k for k in body if k != "weight_dir"), None) if isinstance(body, dict) else "body"
        if extra is not None:
            raise InvalidRequest(extra, "this server's weights come from its own trainer: update_weights takes no "
                                        "body (it syncs them) or only weight_dir")
        api = api_of()
        if isinstance(body, dict) and "weight_dir" in body:
            # prime-rl's orchestrator posts the folder whose STABLE marker it saw. Our trainer writes that marker
            # only after it synced the sampler, so the weights are here already; nothing is read from the folder.
            if not isinstance(body["weight_dir"], (str, type(None))):
                raise InvalidRequest("weight_dir", "must be a path or null")
            return {"message": "Weights are the trainer's, synced before it published them",
                    "weight_version": api.weight_version}
        def publish():
            if job.own_policy is not None:  # the job's own weights, not a Tinker model's the engine may hold
                job.own_policy()
            return api.sync_weights()

        version = await run_in(job.ordered, publish)
        return {"message": "Weights updated", "weight_version": version}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(api_of().weight_version)}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        sampler = api_of().config.sampler
        tensor_parallel = int(sampler.engine_args.get("tensor_parallel_size", 1))
        return {"world_size": tensor_parallel * (sampler.replicas if include_dp else 1)}


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected. Its body was read: what the server hears from it now is only
    that (or the end of the response), as vLLM's own routes listen for it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _fingerprint(api) -> str:
    """OpenAI's `system_fingerprint`, which changes when what answers changes: here the server and the weight
    version that answered the request's start (vLLM's names its version and engine configuration)."""
    return f"arctic-rl-{_version('arctic-rl')}-v{api.weight_version}"


@functools.cache  # an installed version does not change while the server runs; reading it costs a millisecond
def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _engine_version() -> str | None:
    """vLLM's own version string (`vllm.__version__`, as `vllm serve` reports it), where vLLM is installed."""
    try:
        from vllm import __version__
    except ImportError:
        return _version("arctic-rl")
    return __version__


def _result(done: asyncio.Future):
    """A finished future's result; None where it failed or was cancelled."""
    return None if done.cancelled() or done.exception() is not None else done.result()


def _truncated(c: Completion, tokens: int) -> Completion:
    return c.model_copy(update={"token_ids": c.token_ids[:tokens], "logprobs": c.logprobs[:tokens],
                                "token_versions": None if c.token_versions is None else c.token_versions[:tokens]})


def _constraint_field(req, by_tools: bool) -> str:
    """The request's field that brought its structured-outputs constraint (`by_tools`: its tools did)."""
    if by_tools:
        return "tools"
    return "response_format" if req.structured_outputs is None and req.response_format is not None \
        else "structured_outputs"


def _renamed(field_: str, prompt_field: str, indexed: bool, sampling_prefix: str = "",
             constraint: str = "structured_outputs") -> str:
    """A `generate` field as the route names it: prompts[i] -> the prompt field, sampling.x -> x, the constraint
    -> the field that brought it (`constraint`)."""
    if field_.startswith("prompts"):
        return prompt_field + (field_[len("prompts"):] if indexed else "")
    if field_.startswith("sampling.structured_outputs"):
        return constraint + field_[len("sampling.structured_outputs"):]
    if field_.startswith("sampling."):
        return sampling_prefix + field_[len("sampling."):]
    if field_ == "sampling":
        return sampling_prefix.rstrip(".") or "max_tokens"
    return field_


def _top(codec: TextCodec, pairs, as_id: bool) -> list[dict]:
    return [{"token": codec.token_text(t, as_id), "logprob": lp,
             "bytes": list(codec.token_text(t, False).encode())} for t, lp in pairs]


def _chat_logprobs(codec: TextCodec, token_ids: list[int], logprobs: list[float], tops, as_id: bool) -> list[dict]:
    """OpenAI's chat log-prob entries of a reply's tokens (or a streamed piece's)."""
    tops = tops or [[] for _ in token_ids]
    return [{"token": codec.token_text(t, as_id), "logprob": lp, "bytes": list(codec.token_text(t, False).encode()),
             "top_logprobs": _top(codec, top, as_id)} for t, lp, top in zip(token_ids, logprobs, tops)]


def _completion_logprobs(codec: TextCodec, token_ids: list[int], logprobs: list[float], tops, as_id: bool,
                         at: int = 0) -> dict:
    """OpenAI's completion log-probs of a reply's tokens (or of a streamed piece's, whose text starts at `at`)."""
    tokens = [codec.token_text(t, as_id) for t in token_ids]
    offsets = []
    for t in token_ids:
        offsets.append(at)
        at += len(codec.token_text(t, False))
    if tops is not None:
        tops = [{codec.token_text(t, as_id): lp for t, lp in [(tok, own)] + list(top)}
                for tok, own, top in zip(token_ids, logprobs, tops)]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _echoed_logprobs(codec: TextCodec, prompt_ids: list[int], c: Completion, as_id: bool, reply: dict | None) -> dict:
    """vLLM's echoed completion log-probs: the prompt's (the first token's null, having no context), then the
    reply's (`reply`, None for the prompt alone), its text offsets after the prompt's."""
    scored = c.prompt_logprobs or []
    echoed = _completion_logprobs(codec, prompt_ids[1:], [e[0][1] for e in scored], [e[1:] for e in scored], as_id,
                                  len(codec.token_text(prompt_ids[0], False)))
    first = codec.token_text(prompt_ids[0], as_id)
    out = {"tokens": [first] + echoed["tokens"], "token_logprobs": [None] + echoed["token_logprobs"],
           "top_logprobs": [None] + echoed["top_logprobs"], "text_offset": [0] + echoed["text_offset"]}
    if reply is None:
        return out
    at = out["text_offset"][-1] + len(codec.token_text(prompt_ids[-1], False))
    return {key: out[key] + (reply[key] if key != "text_offset" else [at + o for o in reply[key]]) for key in out}


def _ranked(entries) -> dict:
    """vLLM's `{token_id: Logprob}` for one prompt position: the token itself first, then the top k ranked."""
    own, top = entries[0], entries[1:]
    out = {}
    for rank, (t, lp) in enumerate(top, start=1):
        out[t] = {"logprob": lp, "rank": rank}
    out.setdefault(own[0], {"logprob": own[1], "rank": None})
    return out


def _vllm_prompt_logprobs(c: Completion) -> list | None:
    if c.prompt_logprobs is None:
        return None
    return [None] + [_ranked(entries) for entries in c.prompt_logprobs]


def _prompt_logprobs(codec: TextCodec, c: Completion | None, prompt_ids: list[int]) -> list | None:
    if c is None or c.prompt_logprobs is None:
        return None
    return [None] + [{str(t): {**v, "decoded_token": codec.token_text(t, False)} for t, v in _ranked(e).items()}
                     for e in c.prompt_logprobs]


def _token_logprobs(token_ids: list[int], logprobs: list[float], tops, ranks: list[int] | None) -> list[dict]:
    """vLLM's `GenerateLogProbsContent` (the sampled token's rank where the sampler reports it), with the `token`
    as "token_id:<id>" as PrimeRL's renderers client reads."""
    tops = tops or [[] for _ in token_ids]
    ranks = ranks or [None for _ in token_ids]
    return [{"token_id": t, "logprob": lp, "rank": rank or None, "token": f"token_id:{t}",
             "top_logprobs": [{"token_id": a, "logprob": b, "rank": r} for r, (a, b) in enumerate(top, start=1)]}
            for t, lp, top, rank in zip(token_ids, logprobs, tops, ranks)]


class _NoText:
    """The text a token-mode stream sends: none."""

    @staticmethod
    def add(token_ids: list[int]) -> str:
        return ""

    @staticmethod
    def rest(finished: str) -> str:
        return ""


_NO_TEXT = _NoText()
