"""How the daemon serves its API: the uvicorn settings that bound what a client may hold
(header size, idle time, concurrent connections, from the ``api`` section), and the h11
protocol they need, whose idle deadline starts with the connection. What the API reads of a
body, and when, is :class:`xdplb.daemon.api._Gate`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from xdplb.config import ApiConfig
from xdplb.daemon.logs import PEER, peer_of

#: Request line and headers, together: h11's default, said here. The longest header the
#: API needs is the token's (4,096 characters at most).
MAX_HEADER_BYTES = 16 * 1024


class ApiProtocol(H11Protocol):
    """uvicorn's h11 protocol with its keep-alive timeout armed from the connection's
    start, and disarmed only when a request's headers are complete (uvicorn arms it after
    a response and disarms it on any byte, so a client that connected and said nothing, or
    trickled its headers, held a connection for ever); it also leaves the connection's
    peer in every request's state (:class:`~xdplb.daemon.logs.CallerMiddleware` names it)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app_state = {**self.app_state, PEER: peer_of(transport.get_extra_info("socket"))}
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        # As uvicorn's, without disarming: handle_events does on a complete request.
        self.conn.receive_data(data)
        self.handle_events()


def server_options(api: ApiConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.Config`` that bound the clients of ``api``."""
    return {
        "http": ApiProtocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "timeout_keep_alive": api.idle_timeout,
        "limit_concurrency": api.max_connections,
    }
