"""The thin, CPU-only client: the training API over HTTP.

Installs with the base package only (pydantic, httpx, numpy, safetensors):
no torch, DeepSpeed, vLLM or Ray. `ArcticRLClient` blocks; `AsyncArcticRLClient`
awaits; `client.futures.<call>(...)` returns a `concurrent.futures.Future`.
Bodies travel in the safetensors wire format. Errors the server reports come
back as the same exceptions the in-process backend raises. Every call carries
a request id that its retries reuse, so a retried `fwd_bwd` is applied once.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

import httpx

from arctic_rl_core import wire
from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable, InvalidRequest, UnknownName
from arctic_rl_core.protocol import API_PREFIX, REQUEST_ID_HEADER, ROUTES
from arctic_rl_core.server.security import TOKEN_ENV
from arctic_rl_core.types import (
    CheckpointInfo,
    Completion,
    FwdBwdResult,
    LogProbsResult,
    LossSpec,
    SamplingParams,
    Sequence,
    StepResult,
)
from arctic_rl_core.validation import parse

DEFAULT_URL = "http://127.0.0.1:7000"


class Unauthorized(ArcticRLError):
    """The server requires a token, or a different one."""


class ServerError(ArcticRLError):
    """The server failed while running a valid request."""


def _request(name: str, **fields: Any):
    """Validate a call's arguments into its request model (errors name the argument)."""
    return parse(ROUTES[name].request, fields, "")


def _loss(loss: LossSpec | dict | str):
    return {"name": loss} if isinstance(loss, str) else loss


def _raise_for(response: httpx.Response) -> None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"HTTP {response.status_code}: {response.text[:500]}") from None
    kind, field, message = error.get("type"), error.get("field"), error.get("message", "")
    if response.status_code == 401:
        raise Unauthorized(message)
    if 400 <= response.status_code < 500 and field is not None:
        raise (UnknownName if kind == "UnknownName" else InvalidRequest)(field, message)
    raise ServerError(f"{kind}: {message}")


class _ClientCore:
    def __init__(self, url: str, token: str | None, retries: int, backoff_s: float):
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s

    def prepare(self, name: str, request) -> tuple[str, wire.Encoded, dict]:
        """Path, body (streamed: header, then tensor memory) and headers; retries resend the same id."""
        body = wire.encode_parts(request.model_dump(mode="json"))
        headers = {**self.headers, "Content-Type": wire.MEDIA_TYPE, "Content-Length": str(len(body)),
                   REQUEST_ID_HEADER: uuid.uuid4().hex}
        return f"{API_PREFIX}/{name}", body, headers

    def finish(self, name: str, response: httpx.Response):
        if response.status_code != 200:
            _raise_for(response)
        return parse(ROUTES[name].response, wire.decode(response.content), "response")

    def unavailable(self, err: Exception) -> BackendUnavailable:
        return BackendUnavailable(f"cannot reach the Arctic RL server at {self.url} after {self.retries + 1} attempts: {err}")


class ArcticRLClient(TrainingAPI):
    """Blocking client. Connection failures are retried `retries` times with exponential backoff."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float | None = None,
                 retries: int = 3, backoff_s: float = 0.5):
        self._core = _ClientCore(url, token, retries, backoff_s)
        self._http = httpx.Client(base_url=self._core.url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        for attempt in range(self._core.retries + 1):
            try:
                return self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                if attempt == self._core.retries:
                    raise self._core.unavailable(err) from None
                time.sleep(self._core.backoff_s * 2**attempt)

    def _call(self, name: str, request):
        path, body, headers = self._core.prepare(name, request)
        return self._core.finish(name, self._send("POST", path, content=body, headers=headers))

    def _json(self, method: str, route: str, payload: Any = None) -> dict:
        if method == "POST":  # the server requires a content type on every POST
            response = self._send(method, f"{API_PREFIX}/{route}", content=json.dumps(payload or {}).encode(),
                                  headers={**self._core.headers, "Content-Type": "application/json"})
        else:
            response = self._send(method, f"{API_PREFIX}/{route}", headers=self._core.headers)
        if response.status_code != 200:
            _raise_for(response)
        return response.json()

    # -- service ---------------------------------------------------------------------------------

    def health(self) -> dict:
        return self._json("GET", "health")

    def status(self) -> dict:
        return self._json("GET", "status")

    def initialize(self, config: dict) -> dict:
        return self._json("POST", "initialize", config)

    def shutdown(self) -> dict:
        return self._json("POST", "shutdown")

    def close(self) -> None:
        self._http.close()

    # -- the training API ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | dict | None = None) -> list[Completion]:
        return self._call("generate", _request("generate", prompts=prompts, sampling=sampling or {})).completions

    def log_probs(self, sequences: list[Sequence], *, with_entropy: bool = False, temperature: float = 1.0,
                  source: str = "trainer") -> LogProbsResult:
        return self._call("log_probs", _request("log_probs", sequences=sequences, with_entropy=with_entropy, temperature=temperature,
                                                                source=source))

    def fwd_bwd(self, sequences: list[Sequence], loss: LossSpec | dict | str) -> FwdBwdResult:
        return self._call("fwd_bwd", _request("fwd_bwd", sequences=sequences, loss=_loss(loss)))

    def discard_gradients(self) -> None:
        self._call("discard_gradients", _request("discard_gradients"))

    def step(self, learning_rate: float | None = None) -> StepResult:
        return self._call("step", _request("step", learning_rate=learning_rate))

    def sync_weights(self) -> int:
        return self._call("sync_weights", _request("sync_weights")).weight_version

    def save_checkpoint(self, path: str) -> CheckpointInfo:
        return self._call("save_checkpoint", _request("save_checkpoint", path=path))

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        return self._call("load_checkpoint", _request("load_checkpoint", path=path))

    def state_digest(self) -> str:
        return self._call("state_digest", _request("state_digest")).digest

    @property
    def weight_version(self) -> int:
        return self._call("weight_version", _request("weight_version")).weight_version


class AsyncArcticRLClient:
    """asyncio client: every call is a coroutine (`asyncio.create_task` makes it a future)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float | None = None,
                 retries: int = 3, backoff_s: float = 0.5):
        self._core = _ClientCore(url, token, retries, backoff_s)
        self._http = httpx.AsyncClient(base_url=self._core.url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def _call(self, name: str, request):
        path, body, headers = self._core.prepare(name, request)
        for attempt in range(self._core.retries + 1):
            try:
                # httpx.AsyncClient needs an async iterator (it would take `body` as a sync iterable)
                response = await self._http.post(path, content=aiter(body), headers=headers)
                return self._core.finish(name, response)
            except httpx.TransportError as err:
                if attempt == self._core.retries:
                    raise self._core.unavailable(err) from None
                await asyncio.sleep(self._core.backoff_s * 2**attempt)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(self, prompts: list[list[int]], sampling: SamplingParams | dict | None = None) -> list[Completion]:
        return (await self._call("generate", _request("generate", prompts=prompts, sampling=sampling or {}))).completions

    async def log_probs(self, sequences: list[Sequence], *, with_entropy: bool = False, temperature: float = 1.0,
                  source: str = "trainer") -> LogProbsResult:
        return await self._call("log_probs", _request("log_probs", sequences=sequences, with_entropy=with_entropy, temperature=temperature,
                                                                source=source))

    async def fwd_bwd(self, sequences: list[Sequence], loss: LossSpec | dict | str) -> FwdBwdResult:
        return await self._call("fwd_bwd", _request("fwd_bwd", sequences=sequences, loss=_loss(loss)))

    async def discard_gradients(self) -> None:
        await self._call("discard_gradients", _request("discard_gradients"))

    async def step(self, learning_rate: float | None = None) -> StepResult:
        return await self._call("step", _request("step", learning_rate=learning_rate))

    async def sync_weights(self) -> int:
        return (await self._call("sync_weights", _request("sync_weights"))).weight_version

    async def save_checkpoint(self, path: str) -> CheckpointInfo:
        return await self._call("save_checkpoint", _request("save_checkpoint", path=path))

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        return await self._call("load_checkpoint", _request("load_checkpoint", path=path))

    async def state_digest(self) -> str:
        return (await self._call("state_digest", _request("state_digest"))).digest

    async def weight_version(self) -> int:
        return (await self._call("weight_version", _request("weight_version"))).weight_version
