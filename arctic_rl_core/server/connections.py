"""Connection deadlines uvicorn does not set.

uvicorn closes idle keep-alive connections, but waits forever for a request's
headers: a client that connects and sends nothing, or its headers a byte at a
time, holds a connection and its memory indefinitely. `timed_protocol` gives
uvicorn's httptools protocol a deadline from a request's first byte (or the
connection's opening) to the end of its headers. Body reads have their own
per-chunk deadline in the app.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _TimedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    _header_deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def timed_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's `http=` protocol class with this header deadline."""
    return type("TimedHttpToolsProtocol", (_TimedHttpToolsProtocol,), {"header_timeout_s": header_timeout_s})
