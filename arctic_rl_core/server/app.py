"""The FastAPI application: the training API's routes over one job.

Ordered routes (training state) run one at a time, in arrival order, on a
single worker thread; reads (generate, log_probs) run on their own threads so
they proceed while training runs. Bodies are JSON or the safetensors wire
format (`arctic_rl_core.wire`); responses use the request's format.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from arctic_rl_core import wire
from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import ArcticRLError, InvalidRequest, NotFound, Unauthorized, field_path
from arctic_rl_core.patches import applied as applied_patches
from arctic_rl_core.calls import API_PREFIX, CALLS, REQUEST_ID_HEADER, Call, CheckpointRequest
from arctic_rl_core.server.buffers import BufferPool
from arctic_rl_core.server.idempotency import RequestIdConflict, RequestLog
from arctic_rl_core.server.limits import OverLimit, RequestLimits
from arctic_rl_core.server.security import GuardMiddleware, confine, error_body
from arctic_rl_core.serving.routes import Serving, add_serving_routes
from arctic_rl_core.validation import parse

log = logging.getLogger("arctic_rl.server")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 7000
    token: str | None = None
    max_request_bytes: int = 1 << 30
    read_workers: int = 4
    checkpoint_dir: str | None = None
    """Every checkpoint path a request names resolves inside this directory (relative: to the working
    directory). `arctic-rl serve` defaults to ./checkpoints; unset here, a fresh temporary directory."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    header_timeout_s: float = 10.0
    """From a request's first byte to the end of its headers."""
    body_timeout_s: float = 30.0
    """Longest wait for the next piece of a request body."""
    keep_alive_s: float = 30.0
    """An idle keep-alive connection is closed after this long. Longer than clients keep theirs (httpx and the
    openai SDK: 5 s): a server that closes at the moment a client reuses the connection gets its request written
    into a closed socket, which the client reports as a connection error (and agent harnesses do not retry)."""
    max_connections: int = 1024
    """Open connections beyond this are answered 503 (`--max-connections`). Each request in flight holds one, and
    a caller thread while it samples: agent fleets keep hundreds in flight."""
    served_model_name: str | None = None
    """The model name the OpenAI-compatible routes answer to (default: the job's model_path)."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser of this name reads chat replies' tool calls into `tool_calls` (`--tool-call-parser`)."""
    tinker_full_parameter: bool = False
    """The Tinker routes train all parameters of a job without LoRA for a client that asks for LoRA."""
    tinker_tenants: int = 8
    """Tinker models training at once, each from the base model, time-sharing the engine."""
    tinker_keys: dict[str, str] | None = None
    """Tinker tenants' API keys (name -> key): only these are taken on the Tinker routes, each its own tenant, and
    they pass the server's guard there in place of its token."""

    temporary_checkpoint_dir: bool = field(default=False, init=False, repr=False)
    """No directory was given: checkpoints go to a fresh temporary one, removed at shutdown if still empty."""

    def checkpoint_root(self) -> str:
        if self.checkpoint_dir is None:
            self.checkpoint_dir = tempfile.mkdtemp(prefix="arctic-rl-checkpoints-")
            self.temporary_checkpoint_dir = True
        root = os.path.realpath(self.checkpoint_dir)
        os.makedirs(root, exist_ok=True)
        return root


@dataclass
class JobState:
    backend_factory: Callable[[BackendConfig], TrainingAPI]
    api: TrainingAPI | None = None
    config: BackendConfig | None = None
    ordered: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="arctic-train"))
    reads: ThreadPoolExecutor | None = None
    requests: RequestLog = field(default_factory=RequestLog)
    buffers: BufferPool | None = None
    shutdown: Callable[[], None] | None = None
    own_policy: Callable[[], None] | None = None
    """Run on the ordered worker before the training API's calls on the policy: where Tinker's models time-share
    the engine, it brings the job's own policy back into it."""


class NoJob(ArcticRLError):
    pass


class RequestTooLarge(InvalidRequest):
    pass


class BodyTimeout(InvalidRequest):
    pass


class JobConflict(InvalidRequest):
    """`initialize` with a configuration other than the running job's."""


def _error(status: int, exc: Exception) -> JSONResponse:
    field_ = getattr(exc, "field", None)
    message = getattr(exc, "message", None) or str(exc)
    return JSONResponse(error_body(type(exc).__name__, field_, message, status), status_code=status)


class Body:
    """A request body read as it streams in, never over the cap, into a (pooled) buffer.

    `async with Body(request, settings, pool) as body:` gives a memoryview valid inside the block.
    """

    def __init__(self, request: Request, cap: int, pool: BufferPool, timeout_s: float):
        self.request, self.cap, self.pool, self.timeout_s = request, cap, pool, timeout_s
        self.buffer = None
        self.reader: Future | None = None

    def read_by(self, work: Future) -> Future:
        """`work` reads arrays that are views of this body: its buffer goes back to the pool only once
        `work` is done, even if the request is cancelled (the client gone) while it runs."""
        self.reader = work
        return work

    async def _chunks(self):
        """The body's pieces, each within the deadline: a client that stalls mid-body is cut off."""
        stream = self.request.stream()
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), self.timeout_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise BodyTimeout("body", f"no data for {self.timeout_s} s") from None
            yield chunk

    async def __aenter__(self) -> memoryview:
        declared = self.request.headers.get("content-length")
        if declared is None:  # chunked upload: grow as it comes
            data = bytearray()
            async for chunk in self._chunks():
                if len(data) + len(chunk) > self.cap:
                    raise RequestTooLarge("body", f"more than the server's cap of {self.cap} bytes")
                data.extend(chunk)
            return memoryview(data)
        expected = int(declared)  # the guard middleware has checked it against the cap
        self.buffer = self.pool.acquire(expected)
        view = memoryview(self.buffer)
        size = 0
        async for chunk in self._chunks():
            if size + len(chunk) > expected:
                raise wire.WireError(f"body is longer than its declared {expected} bytes")
            view[size : size + len(chunk)] = chunk
            size += len(chunk)
        if size != expected:
            raise wire.WireError(f"body ended after {size} of {expected} declared bytes")
        view.release()
        return memoryview(self.buffer)[:size]

    async def __aexit__(self, *exc) -> None:
        if self.buffer is None:
            return
        buffer, pool = self.buffer, self.pool
        if self.reader is None:
            pool.release(buffer)
        else:  # runs now if the work is done, else in the worker thread when it is
            self.reader.add_done_callback(lambda _: pool.release(buffer))


def _decode(body: memoryview, content_type: str, arrays: bool = False) -> Any:
    """The message in a body; with `arrays`, the wire format's tensors as numpy views of the body."""
    if content_type.startswith(wire.MEDIA_TYPE):
        return wire.decode(body, arrays=arrays)
    if content_type.startswith("application/json"):
        if not len(body):
            return {}
        try:
            return json.loads(bytes(body))
        except (ValueError, RecursionError) as err:
            raise InvalidRequest("body", f"malformed JSON: {err}") from None
    raise InvalidRequest("content-type", f"{content_type!r} is neither application/json nor {wire.MEDIA_TYPE}")


def _encode(model, wire_format: bool) -> Response:
    data = model.model_dump(mode="json")
    if wire_format:
        return Response(wire.encode(data), media_type=wire.MEDIA_TYPE)
    return JSONResponse(data)


def create_app(settings: ServerSettings, backend_factory: Callable[[BackendConfig], TrainingAPI]) -> FastAPI:
    app = FastAPI(title="Arctic RL", version="1", summary="The training API of Arctic RL over HTTP.")
    job = JobState(backend_factory=backend_factory,
                   reads=ThreadPoolExecutor(settings.read_workers, thread_name_prefix="arctic-read"),
                   buffers=BufferPool(max_pooled_bytes=2 * settings.max_request_bytes))
    checkpoint_root = settings.checkpoint_root()
    serving = app.state.serving = Serving(settings.served_model_name, settings.tool_call_parser,
                                          max_concurrent=settings.max_connections)

    def read(request: Request) -> Body:
        return Body(request, settings.max_request_bytes, job.buffers, settings.body_timeout_s)
    app.state.job, app.state.settings = job, settings
    app.add_middleware(GuardMiddleware, token=settings.token, max_request_bytes=settings.max_request_bytes,
                       tinker_keys=tuple((settings.tinker_keys or {}).values()))

    @app.exception_handler(InvalidRequest)
    async def invalid(request, exc: InvalidRequest):
        if isinstance(exc, NotFound):
            return _error(404, exc)
        if isinstance(exc, Unauthorized):
            return _error(401, exc)
        if isinstance(exc, (RequestTooLarge, OverLimit)):
            return _error(413, exc)
        if isinstance(exc, BodyTimeout):
            return _error(408, exc)
        return _error(409 if isinstance(exc, (RequestIdConflict, JobConflict)) else 400, exc)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        # Unknown routes and wrong methods answer in the same shape as every other error.
        field_ = "method" if exc.status_code == 405 else "path"
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, type(exc).__name__)
        return JSONResponse(error_body(kind, field_, f"{request.method} {request.url.path}: {exc.detail}", exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request, exc: RequestValidationError):
        # Query parameters of the control routes (`/pause?mode=`), in the same shape.
        first = exc.errors()[0]
        return _error(400, InvalidRequest(field_path("", tuple(first["loc"][1:])), first["msg"]))

    @app.exception_handler(NoJob)
    async def no_job(request, exc):
        return _error(409, exc)

    @app.exception_handler(Exception)
    async def failure(request, exc: Exception):
        log.exception("request failed")
        return _error(500, exc)

    async def run_in(executor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    @app.get(f"{API_PREFIX}/health")
    async def health():
        return {"status": "ok"}

    @app.get(f"{API_PREFIX}/status")
    async def status():
        api = job.api
        return {
            "initialized": api is not None,
            "config": job.config.model_dump() if job.config else None,
            "weight_version": api.weight_version if api else None,
            "backend": api.describe() if api is not None and hasattr(api, "describe") else None,
            "serving": serving.describe(),
            "patches": applied_patches(),
        }

    @app.post(f"{API_PREFIX}/initialize")
    async def initialize(request: Request):
        async with read(request) as body:
            config = parse(BackendConfig, _decode(body, request.headers.get("content-type", "")), "")
        if job.api is not None:
            if config != job.config:
                raise JobConflict("body", "a job with a different configuration is already running on this server")
            return {"initialized": True, "config": job.config.model_dump()}

        def load():
            if job.api is None:  # the ordered worker runs one load at a time
                job.api, job.config = job.backend_factory(config), config

        await run_in(job.ordered, load)
        return {"initialized": True, "config": job.config.model_dump()}

    @app.post(f"{API_PREFIX}/shutdown")
    async def shutdown():
        if job.shutdown is not None:
            asyncio.get_running_loop().call_soon(job.shutdown)
        return {"status": "shutting down"}

    @app.post(f"{API_PREFIX}/echo")
    async def echo(request: Request):
        """Decode a message and report its size: measures the wire path alone (`arctic-rl bench server`)."""
        async with read(request) as body:
            if request.headers.get("content-type", "").startswith(wire.MEDIA_TYPE):
                message = wire.decode(body, arrays=True)
            else:
                message = _decode(body, request.headers.get("content-type", ""))
            return {"bytes": len(body), "keys": sorted(message) if isinstance(message, dict) else []}

    def add_route(route: Call):
        async def handler(request: Request):
            content_type = request.headers.get("content-type", "")
            # Token ids and per-token floats stay numpy views of the body's buffer all the way to the
            # engine, so the buffer returns to its pool only when the call is done.
            reader = read(request)
            async with reader as body:
                if job.api is None:
                    raise NoJob(f"no job is initialized: POST {API_PREFIX}/initialize first")
                query = parse(route.request, _decode(body, content_type, arrays=True), "")
                settings.limits.check(route.name, query)
                if isinstance(query, CheckpointRequest):
                    query.path = confine(checkpoint_root, query.path)
                # The trainer's log-probs read the engine's weights: where others' may be in it, they wait their turn.
                if route.ordered or route.name == "log_probs" and job.own_policy is not None:
                    request_id = request.headers.get(REQUEST_ID_HEADER)

                    def invoke(api, query):
                        if job.own_policy is not None:
                            job.own_policy()
                        return route.invoke(api, query)

                    async def apply():
                        return await asyncio.wrap_future(reader.read_by(job.ordered.submit(invoke, job.api, query)))

                    if request_id:
                        fingerprint = hashlib.sha256(route.name.encode() + body).hexdigest()
                        result = await job.requests.once(request_id, fingerprint, apply)
                    else:
                        result = await apply()
                else:
                    result = await asyncio.wrap_future(reader.read_by(job.reads.submit(route.invoke, job.api, query)))
            return _encode(result, wire_format=content_type.startswith(wire.MEDIA_TYPE))

        schema = route.request.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)  # added to components by openapi() below
        response_schema = route.response.model_json_schema(ref_template="#/components/schemas/{model}")
        response_schema.pop("$defs", None)
        app.add_api_route(
            route.path, handler, methods=["POST"], name=route.name,
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/json": {"schema": schema}, wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
            responses={200: {"content": {"application/json": {"schema": response_schema}}}},
        )

    for route in CALLS.values():
        add_route(route)

    async def read_json(request: Request) -> Any:
        cap = min(settings.max_request_bytes, settings.limits.serving_body_bytes)
        if int(request.headers.get("content-length") or 0) > cap:
            raise OverLimit("body", f"{request.headers['content-length']} bytes exceed the server's limit "
                                    f"serving_body_bytes={cap}")
        async with Body(request, cap, job.buffers, settings.body_timeout_s) as body:
            content_type = request.headers.get("content-type", "application/json")
            if not content_type.startswith("application/json"):
                raise InvalidRequest("content-type", f"{content_type!r}: these routes take application/json")
            return _decode(body, content_type)

    def api_of() -> TrainingAPI:
        if job.api is None:
            raise NoJob(f"no job is initialized: POST {API_PREFIX}/initialize first")
        return job.api

    add_serving_routes(app, serving, job, api_of, read_json, settings.limits, run_in)

    async def read_bytes(request: Request) -> bytes:
        async with read(request) as body:
            return bytes(body)

    try:
        from arctic_rl_core.tinker.routes import TinkerState, add_tinker_routes
    except ImportError:  # the `tinker` extra is not installed: no Tinker routes
        pass
    else:
        tinker = TinkerState(full_parameter=settings.tinker_full_parameter, max_models=settings.tinker_tenants,
                             keys=settings.tinker_keys)
        add_tinker_routes(app, tinker, job, api_of, serving,
                          read_json, read_bytes, settings.limits, checkpoint_root)

    base_openapi = app.openapi

    def openapi():
        spec = base_openapi()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for route in CALLS.values():
            for model in (route.request, route.response):
                schemas.update(model.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs", {}))
        return spec

    app.openapi = openapi
    return app
