"""The request path every sampling route shares: the request parsed and checked, sampled on the job's sampler (the
server's pause and the client's disconnect heeded), captured in its session, and answered whole or streamed as the
engine samples."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.errors import ArcticRLError, InvalidRequest, NotFound
from arctic_rl_core.serving.pause import Aborted, ClientGone
from arctic_rl_core.serving.protocol import parse_request
from arctic_rl_core.serving.text import StreamedText
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


class RequestPath:
    """What the routes share, on one server: `api_of()` is the job's training API (or the server's error for no job);
    `read_json` reads a request's body within the server's caps; `limits` caps each request's work."""

    def __init__(self, serving, job, api_of: Callable[[], Any], read_json: Callable[[Request], Awaitable[Any]], limits):
        self.serving, self.job, self.api_of, self.read_json, self.limits = serving, job, api_of, read_json, limits

    def check_model(self, api, name: str | None) -> str:
        served = self.serving.model_name(api)
        if name is not None and name != served:
            raise ModelNotFound("model", f"the model {name!r} does not exist; this server serves {served!r}")
        return served

    def session_of(self, request: Request, body_session: str | None) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if body_session is None and header is not None:
            if not 0 < len(header) <= SESSION_ID_CHARS:
                raise InvalidRequest(SESSION_HEADER, f"must be 1 to {SESSION_ID_CHARS} characters")
            return header
        return body_session

    def max_tokens(self, api, requested: int | None, prompts: list[list[int]]) -> int:
        """What was asked, or (chat, token route) the rest of the context within the server's cap."""
        if requested is not None:
            return requested
        room = api.sampler.max_context - max(map(len, prompts))
        if room < 1:
            raise InvalidRequest("max_tokens", f"the prompt fills the model's context ({api.sampler.max_context} tokens)")
        return min(room, self.limits.max_tokens)

    def check(self, api, prompts: list[list[int]], sampling: SamplingParams, fields: Callable[[str], str]) -> None:
        """A bad request is refused on its own (never joining, and failing, a batch), naming the route's fields."""
        try:
            self.limits.check("generate", GenerateRequest(prompts=prompts, sampling=sampling))
            api.checked_generate(prompts, sampling)
        except InvalidRequest as err:
            raise type(err)(fields(err.field), err.message) from None

    async def sample(self, api, route: str, prompts: list[list[int]], sampling: SamplingParams, session: str | None,
                     fields: Callable[[str], str], request: Request, on_tokens: Callable | None = None,
                     cancel: Cancellation | None = None) -> Sampled | None:
        """Generate on the job's sampler (one pool, one weight version with `generate`); capture if asked.
        Errors name the route's own fields. `on_tokens`: as `generate`'s, on a continuously batched sampler.

        A client that disconnects before its answer (a turn's timeout, an agent ending early) cancels the call: the
        sampler ends its requests at its next step, and a session records the turn as cancelled with no tokens,
        which is what the client received; None is returned. With `cancel` the caller watches the client itself
        (a stream) and records what it sent."""
        self.check(api, prompts, sampling, fields)
        watched = cancel is None
        cancel = cancel or Cancellation()
        try:
            async with self.serving.gate.admitted() as abort:
                work = asyncio.ensure_future(self.serving.generate(api, self.job.reads, prompts, sampling, on_tokens, cancel))
                gone = asyncio.ensure_future(_client_gone(request)) if watched else None
                try:
                    completions = await self.serving.gate.run(abort, work, gone)
                except Aborted:
                    # A continuously batched sampler answers it with what it sampled so far (the pause ends its
                    # requests in flight); another sampler's call runs on, and its answer is dropped.
                    completions = await work if api.sampler.continuous_batching else None
                except ClientGone:
                    cancel.cancel()
                    self.serving.cancelled += 1
                    if session is not None:
                        work.add_done_callback(lambda done: self.record_sent(api, session, prompts, _result(done), {}))
                    return None
                finally:
                    if gone is not None:
                        gone.cancel()
        except InvalidRequest as err:
            raise type(err)(fields(err.field), err.message) from None
        self.serving.requests[route] += 1
        if session is not None and completions is not None and watched:
            api.trajectories.record(session, prompts, completions)
        return Sampled(prompts, completions, sampling.n)

    def record_sent(self, api, session: str, prompts: list[list[int]], completions: list[Completion] | None,
                    sent: dict[int, int]) -> None:
        """A cancelled request's turns as its client received them, marked cancelled: the first `sent[choice]`
        tokens of each choice (none where absent), from the sampler's answer once it ended the call (which may hold
        tokens the client never got)."""
        if completions is None:  # the call failed, or a pause aborted it before it sampled
            return
        api.trajectories.record(session, prompts, [_truncated(c, sent.get(i, 0)) for i, c in enumerate(completions)],
                                cancelled=True)

    async def begin(self, request: Request, schema):
        """The request parsed, the job's API, and the served model's name (checked against the request's)."""
        req = parse_request(schema, await self.read_json(request))
        api = self.api_of()
        return req, api, self.check_model(api, req.model)

    def streams(self, req, api, sampling: SamplingParams, logprobs) -> bool:
        """Whether the request's text is sent as the engine samples it (`stream` on a sampler that streams tokens),
        with each piece's log-probs (if `logprobs` asks for them). Whole at the end: prompt log-probs, and the
        model's own log-probs of reshaped sampling (`logprobs_of: model`), which the sampler has by scoring the
        reply again."""
        rescored = sampling.logprobs_of == "model" and sampling.reshaped_by() is not None
        return (bool(req.stream) and api.sampler.streams_tokens and sampling.prompt_logprobs is None
                and not (logprobs is not None and logprobs is not False and rescored))

    def stream_as_sampled(self, api, route: str, request: Request, prompts: list[list[int]], sampling: SamplingParams,
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
        self.check(api, prompts, sampling, fields)
        interval = interval or 1
        handoff = self.serving.handoff()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = Cancellation()

        def on_tokens(prompt: int, sample: int, token_ids: list[int], logprobs: list[float], tops, ranks) -> None:
            # on the engine's thread: handed to the event loop
            handoff.put(pieces, (prompt * sampling.n + sample, token_ids, logprobs, tops, ranks))

        work = asyncio.ensure_future(self.sample(api, route, prompts, sampling, session, fields, request, on_tokens, cancel))
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
                    self.serving.cancelled += 1
                    if session is not None:
                        work.add_done_callback(lambda done: self.record_sent(
                            api, session, prompts, getattr(_result(done), "completions", None), sent))
        return StreamingResponse(events(), media_type="text/event-stream")

    def respond(self, req, payload: dict, chunks: Callable[[dict], list[dict]], head: dict):
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


def weight_spans(c: Completion) -> list[dict]:
    """vLLM's weight-version spans: which version sampled tokens [start, end) (several where a sync crossed it)."""
    versions = c.token_versions or [c.weight_version] * len(c.token_ids)
    spans = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans or [{"version": str(c.weight_version), "start": 0, "end": 0}]


def fingerprint(api) -> str:
    """OpenAI's `system_fingerprint`, which changes when what answers changes: here the server and the weight
    version that answered the request's start (vLLM's names its version and engine configuration)."""
    return f"arctic-rl-{installed_version('arctic-rl')}-v{api.weight_version}"


@functools.cache  # an installed version does not change while the server runs; reading it costs a millisecond
def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def constraint_field(req, by_tools: bool) -> str:
    """The request's field that brought its structured-outputs constraint (`by_tools`: its tools did)."""
    if by_tools:
        return "tools"
    return "response_format" if req.structured_outputs is None and req.response_format is not None \
        else "structured_outputs"


def renamed(field_: str, prompt_field: str, indexed: bool, sampling_prefix: str = "",
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


def _joined(first: tuple | None, then: tuple) -> tuple:
    """Two stream pieces (text, token ids, log-probs, top log-probs, ranks) as one."""
    if first is None:
        return then
    return tuple(a + b if a is not None and b is not None else None for a, b in zip(first, then))


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected. Its body was read: what the server hears from it now is only
    that (or the end of the response), as vLLM's own routes listen for it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result(done: asyncio.Future):
    """A finished future's result; None where it failed or was cancelled."""
    return None if done.cancelled() or done.exception() is not None else done.result()


def _truncated(c: Completion, tokens: int) -> Completion:
    return c.model_copy(update={"token_ids": c.token_ids[:tokens], "logprobs": c.logprobs[:tokens],
                                "token_versions": None if c.token_versions is None else c.token_versions[:tokens]})
