"""The HTTP/1.1 protocol both servers (`ember serve`, `ember gateway`) run under uvicorn: uvicorn's
httptools protocol plus a header-read timeout.

uvicorn closes a kept-alive connection that stays silent (`timeout_keep_alive`), but every byte
received re-arms that timer, and a fresh connection has none: a client that sends a request's
headers a byte at a time (slowloris) holds a connection and its file descriptor for as long as it
likes. This protocol closes any connection whose request headers are not complete `header_timeout_s`
after the connection opened or after the request's first byte arrived; requests whose headers are
complete are never touched, however long their body or response takes.

    uvicorn.Config(app, http=header_timeout_protocol(10.0), ...)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember.errors import EmberError

DEFAULT_HEADER_TIMEOUT_S = 10.0

logger = logging.getLogger("ember.http")


class HeaderTimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()  # a connection that never sends a byte is held to the limit too

    def on_message_begin(self) -> None:  # the first byte of a request
        super().on_message_begin()
        self._start_header_timer()

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is None:  # already running since the connection opened: keep that deadline
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.debug("closing %s: no complete request headers within %g s", self.client, self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> Callable[..., HeaderTimeoutProtocol]:
    """What to pass as uvicorn's `http=`: the protocol with this header-read timeout, in seconds."""
    if not header_timeout_s > 0:
        raise EmberError(f"--header-timeout must be above 0 seconds, got {header_timeout_s:g}")
    return functools.partial(HeaderTimeoutProtocol, header_timeout_s=header_timeout_s)
