"""Who may talk to the server, and how much they may send.

Loopback binds need no token; any other bind requires one, and once a token
is set every request must carry it (`Authorization: Bearer ...`), compared in
constant time. Bodies over the cap are refused before they are read.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

TOKEN_ENV = "ARCTIC_RL_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise SystemExit(
            f"refusing to bind {host}: off-loopback the server needs a token (--token or ${TOKEN_ENV})"
        )


class GuardMiddleware:
    """ASGI middleware: token check and request-size cap on every HTTP request."""

    def __init__(self, app, token: str | None, max_request_bytes: int):
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                missing = not given
                return await _error(send, 401, "Unauthorized", "authorization",
                                    "a bearer token is required" if missing else "the bearer token is wrong")
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


async def _error(send, status: int, kind: str, field: str, message: str) -> None:
    body = json.dumps({"error": {"type": kind, "field": field, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
