"""The thin, CPU-only client: the training API over HTTP.

Installs with the base package only (pydantic, httpx, numpy, safetensors):
no torch, DeepSpeed, vLLM or Ray. `ArcticRLClient` blocks; `AsyncArcticRLClient`
awaits; `client.futures.<call>(...)` returns a `concurrent.futures.Future`.
Bodies travel in the safetensors wire format. Errors the server reports come
back as the same exceptions the in-process backend raises. Every call carries
a request id that its retries reuse, so a retried `fwd_bwd` is applied once.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import json
import os
import time
import uuid
from typing import Any

import httpx

from arctic_rl_core import wire
from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable, InvalidRequest, UnknownName
from arctic_rl_core.calls import API_PREFIX, CALLS, REQUEST_ID_HEADER, Call
from arctic_rl_core.server.security import TOKEN_ENV
from arctic_rl_core.validation import parse

DEFAULT_URL = "http://127.0.0.1:7000"


class Unauthorized(ArcticRLError):
    """The server requires a token, or a different one."""


class ServerError(ArcticRLError):
    """The server failed while running a valid request."""


def _request(call: Call, args: tuple, kwargs: dict):
    """A call's arguments, bound to `TrainingAPI`'s signature, validated into its request model
    (errors name the argument) before anything is sent."""
    if call.attribute:
        return call.request()
    bound = inspect.signature(getattr(TrainingAPI, call.name)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    fields = dict(bound.arguments)
    fields.pop("self")
    return parse(call.request, fields, "")


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

    def prepare(self, call: Call, request) -> tuple[str, wire.Encoded, dict]:
        """Path, body (streamed: header, then tensor memory) and headers; retries resend the same id."""
        body = wire.encode_parts(request.model_dump())  # arrays stay arrays: sent from their own memory
        headers = {**self.headers, "Content-Type": wire.MEDIA_TYPE, "Content-Length": str(len(body)),
                   REQUEST_ID_HEADER: uuid.uuid4().hex}
        return call.path, body, headers

    def finish(self, call: Call, response: httpx.Response):
        if response.status_code != 200:
            _raise_for(response)
        return call.value_of(parse(call.response, wire.decode(response.content), "response"))

    def unavailable(self, err: Exception) -> BackendUnavailable:
        return BackendUnavailable(f"cannot reach the Arctic RL server at {self.url} after {self.retries + 1} attempts: {err}")


class ArcticRLClient(TrainingAPI):
    """Blocking client. Connection failures are retried `retries` times with exponential backoff."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float | None = None,
                 retries: int = 3, backoff_s: float = 0.5):
        self._core = _ClientCore(url, token, retries, backoff_s)
        self._http = httpx.Client(base_url=self._core.url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    @property
    def url(self) -> str:
        return self._core.url

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        for attempt in range(self._core.retries + 1):
            try:
                return self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                if attempt == self._core.retries:
                    raise self._core.unavailable(err) from None
                time.sleep(self._core.backoff_s * 2**attempt)

    def _call(self, call: Call, args: tuple = (), kwargs: dict | None = None):
        path, body, headers = self._core.prepare(call, _request(call, args, kwargs or {}))
        return self._core.finish(call, self._send("POST", path, content=body, headers=headers))

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


class AsyncArcticRLClient:
    """asyncio client: every call is a coroutine (`asyncio.create_task` makes it a future)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float | None = None,
                 retries: int = 3, backoff_s: float = 0.5):
        self._core = _ClientCore(url, token, retries, backoff_s)
        self._http = httpx.AsyncClient(base_url=self._core.url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def _call(self, call: Call, args: tuple = (), kwargs: dict | None = None):
        path, body, headers = self._core.prepare(call, _request(call, args, kwargs or {}))
        for attempt in range(self._core.retries + 1):
            try:
                # httpx.AsyncClient needs an async iterator (it would take `body` as a sync iterable)
                response = await self._http.post(path, content=aiter(body), headers=headers)
                return self._core.finish(call, response)
            except httpx.TransportError as err:
                if attempt == self._core.retries:
                    raise self._core.unavailable(err) from None
                await asyncio.sleep(self._core.backoff_s * 2**attempt)

    async def aclose(self) -> None:
        await self._http.aclose()


def _sync_method(call: Call):
    if call.attribute:
        return property(lambda self: self._call(call), doc=getattr(TrainingAPI, call.name).__doc__)

    @functools.wraps(getattr(TrainingAPI, call.name))
    def method(self, *args, **kwargs):
        return self._call(call, args, kwargs)

    method.__isabstractmethod__ = False  # `wraps` copied the abstract marker along with the docstring
    return method


def _async_method(call: Call):
    api_method = getattr(TrainingAPI, call.name)

    async def method(self, *args, **kwargs):
        return await self._call(call, args, kwargs)

    method.__name__ = method.__qualname__ = call.name
    method.__doc__ = (api_method.fget if call.attribute else api_method).__doc__
    return method


# Every call of the table becomes a method of both clients, with `TrainingAPI`'s signature and docstring.
for _call in CALLS.values():
    setattr(ArcticRLClient, _call.name, _sync_method(_call))
    setattr(AsyncArcticRLClient, _call.name, _async_method(_call))
abc.update_abstractmethods(ArcticRLClient)
