"""Errors raised by the training API.

Every error a caller can cause names the offending field, so a framework can
report it without reading our source. A call that raises `InvalidRequest`
has changed no state.
"""

from __future__ import annotations


class ArcticRLError(Exception):
    """Base class of all Arctic RL errors."""


class InvalidRequest(ArcticRLError, ValueError):
    """The request is malformed. `field` is a dotted path into the request."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        # Picklable with its field (a trainer rank's refusal crosses Ray to the driver), whatever a
        # subclass's own constructor takes.
        return _rebuilt, (type(self), self.field, self.message)


def _rebuilt(cls: type, field: str, message: str) -> InvalidRequest:
    error = cls.__new__(cls)
    InvalidRequest.__init__(error, field, message)
    return error


class NotFound(InvalidRequest):
    """What the request names does not exist, or is not the caller's to see (HTTP 404)."""


class Unauthorized(InvalidRequest):
    """The request's credentials are missing or unknown (HTTP 401)."""


class UnknownName(InvalidRequest):
    """A loss, post-processor, engine or sampler name that no plugin provides."""

    @classmethod
    def of(cls, field: str, kind: str, name: str, known: list[str]) -> "UnknownName":
        return cls(field, f"unknown {kind} {name!r}; known: {', '.join(sorted(known)) or 'none'}")


class BackendUnavailable(ArcticRLError):
    """The server could not be reached, or the connection broke, after the allowed retries."""


def field_path(prefix: str, loc: tuple) -> str:
    """('sequences', 0, 'advantages') -> 'sequences[0].advantages', under `prefix`."""
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


class PluginError(ArcticRLError):
    """A plugin failed to load or register."""
