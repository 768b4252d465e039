"""uvicorn's h11 protocol with the two limits uvicorn lacks: a time limit on a request's
headers (a client that opens a connection and trickles its request line, Slowloris, otherwise
holds it forever, and a connection that never sends anything too) and a cap on open
connections (uvicorn's limit_concurrency answers 503 but still keeps every connection, and its
file descriptor). The body's own time limit is middleware.BodyLimit's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from memspec.config import Settings
from memspec.server.errors import RequestTimeout, error_body, error_json
from memspec.units import parse_size

log = logging.getLogger("memspec.server")

FD_RESERVE = 128  # descriptors for models, logs, sockets of our own, the RPC link
MIN_CONNECTIONS, MAX_CONNECTIONS = 16, 4096


def connection_cap(settings: Settings) -> int:
    """Open connections at most: `max_connections`, else what the process's descriptors allow
    after a reserve, and what the budget allows if each connection held a whole body (an
    eighth of the budget for request bodies in all)."""
    if settings.max_connections:
        return settings.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_fds = (soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else MAX_CONNECTIONS
    by_memory = settings.budget_bytes // 8 // max(1, parse_size(settings.max_body))
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, by_fds, by_memory))


def _raw_response(status: int, reason: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + raw


class GuardedH11Protocol(H11Protocol):
    """Set by `protocol_for`: the header time limit and the connection cap."""

    header_timeout_s: float = 10.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            # Refused before reading anything: the descriptor is given back at once.
            body = error_body(
                f"too many open connections (max_connections {self.max_connections}); retry",
                "server_error",
                code="too_many_connections",
            )
            transport.write(_raw_response(503, "Service Unavailable", body))
            transport.close()
            return
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Timed while the connection waits for a request's headers (h11: their state IDLE)."""
        if self.transport.is_closing():
            return
        waiting = self.conn.their_state is h11.IDLE
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)
        elif not waiting:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of ours in flight: say why, then close
            exc = RequestTimeout(
                f"request headers not received within {self.header_timeout_s:g} s",
                code="request_timeout",
            )
            self.transport.write(_raw_response(408, "Request Timeout", error_json(exc)))
        self.transport.close()


def protocol_for(settings: Settings) -> type[GuardedH11Protocol]:
    """A protocol class with this daemon's limits (uvicorn builds one per connection)."""
    return type(
        "MemSpecH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout_s": settings.header_timeout_s,
            "max_connections": connection_cap(settings),
        },
    )
