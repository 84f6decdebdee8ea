"""Who may talk to the server, and how much they may send.

Loopback binds need no token; any other bind requires one, and once a token
is set every request must carry it (`Authorization: Bearer ...`), compared in
constant time. Without a token, only loopback `Host` values and loopback (or
no) `Origin`s are served: a web page in the user's browser cannot reach the
server by DNS rebinding or a cross-site form. Every POST with a body names
its content type. Bodies over the cap are refused before they are read; checkpoint paths
stay inside the server's checkpoint directory.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from urllib.parse import urlsplit

from arctic_rl_core.errors import InvalidRequest

TOKEN_ENV = "ARCTIC_RL_TOKEN"
TINKER_PREFIX = "/api/v1/"
SIGNED_PREFIX = TINKER_PREFIX + "signed/"
"""GETs under it carry their own capability (an unguessable token that expires: `tinker.rest`'s downloads), fetched
without the API key: with a server token, the token check passes them; without one, the loopback checks still hold."""
"""The Tinker routes' paths (`arctic_rl_core/tinker/routes.py`)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(authority: str) -> str:
    """'127.0.0.1:7000' -> '127.0.0.1'; '[::1]:7000' -> '::1'."""
    try:
        return urlsplit(f"//{authority}").hostname or ""
    except ValueError:
        return ""


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise SystemExit(
            f"refusing to bind {host}: off-loopback the server needs a token (--token or ${TOKEN_ENV})"
        )


def confine(root: str, path: str) -> str:
    """`path` (relative to `root`, or absolute) resolved with its symlinks; refused unless inside `root`."""
    if "\x00" in path:
        raise InvalidRequest("path", "must not contain NUL")
    resolved = os.path.realpath(os.path.join(root, path))
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise InvalidRequest("path", f"{path!r} is outside the server's checkpoint directory {root}")
    return resolved


class GuardMiddleware:
    """ASGI middleware: token or loopback origin, content type and request-size cap on every HTTP request."""

    def __init__(self, app, token: str | None, max_request_bytes: int, tinker_keys: tuple[str, ...] = ()):
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_request_bytes = max_request_bytes
        self.tinker_keys = tuple(f"Bearer {key}".encode() for key in tinker_keys)
        """Tinker tenants' keys: taken in place of the token on the Tinker routes only."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        signed = scope["method"] == "GET" and scope["path"].startswith(SIGNED_PREFIX)
        if self.expected is not None and not signed:
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers and not given:  # the Tinker SDK's header carries the same token
                given = b"Bearer " + headers[b"x-api-key"]
            tenant = scope["path"].startswith(TINKER_PREFIX) and any(
                [hmac.compare_digest(given, key) for key in self.tinker_keys])  # a list: every key compared
            if not tenant and not hmac.compare_digest(given, self.expected):
                missing = not given
                return await _error(send, 401, "Unauthorized", "authorization",
                                    "a bearer token is required" if missing else "the bearer token is wrong")
        elif self.expected is None:
            host = headers.get(b"host", b"").decode("latin-1")
            if not is_loopback(_host_of(host)):
                return await _error(send, 403, "Forbidden", "host",
                                    f"{host!r} is not a loopback host; without a token only loopback is served")
            origin = headers.get(b"origin")
            if origin is not None and not is_loopback(urlsplit(origin.decode("latin-1")).hostname or ""):
                return await _error(send, 403, "Forbidden", "origin",
                                    "cross-origin requests are refused; without a token only loopback pages are served")
        if scope["method"] == "POST" and not headers.get(b"content-type") and headers.get(b"content-length") != b"0":
            return await _error(send, 415, "InvalidRequest", "content-type",
                                "every POST names its content type (application/json or the wire format)")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_request_bytes
            except ValueError:
                return await _error(send, 400, "InvalidRequest", "content-length", "is not an integer")
            if too_big:
                return await _error(send, 413, "RequestTooLarge", "body",
                                    f"{int(length)} bytes exceed the server's cap of {self.max_request_bytes}")
        return await self.app(scope, receive, send)


def error_body(kind: str, field: str | None, message: str, status: int) -> dict:
    """Every error's shape: the training API's (`type`, `field`, `message`) and OpenAI's (`message`, `type`,
    `param`, `code`) at once, so both kinds of client read it."""
    return {"error": {"type": kind, "field": field, "message": message, "param": field, "code": status}}


async def _error(send, status: int, kind: str, field: str, message: str) -> None:
    body = json.dumps(error_body(kind, field, message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
