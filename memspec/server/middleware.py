"""ASGI middleware: Host/Origin guard and CORS (403), request body limit (413) and time limit
(408), per-endpoint request counting.

Pure ASGI (no BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memspec.server.errors import (
    Forbidden,
    PayloadTooLarge,
    RequestTimeout,
    body_for_path,
    error_json,
)
from memspec.server.metrics import Metrics

DRAIN_MAX = 16 << 20  # bytes of an oversize body read and dropped so the 413 gets through


async def _send_error(
    scope: Scope, send: Send, status: int, body: dict[str, Any], close: bool = True
) -> None:
    raw = json.dumps(body_for_path(scope.get("path", ""), body)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


# --- Host and Origin -------------------------------------------------------------------------

WILDCARD_BINDS = ("", "0.0.0.0", "::", "[::]")
CORS_METHODS = b"GET, HEAD, POST, DELETE, OPTIONS"  # DELETE: Ollama's /api/delete
CORS_HEADERS = b"Authorization, Content-Type"


def host_name(value: str) -> str:
    """ "Example.test:8000" -> "example.test"; "[::1]:80" -> "::1" (no port, no trailing dot)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback_name(name: str) -> bool:
    """A loopback literal or a *.localhost name (RFC 6761: never sent to DNS). No lookup here:
    a rebinding attacker's own name resolves to 127.0.0.1 too."""
    ip = _ip(name)
    if ip is not None:
        return ip.is_loopback
    return name == "localhost" or name.endswith(".localhost")


class HostGuard:
    """With no key set, the daemon's only protection is that it listens on loopback. A web page
    can still reach it: by DNS rebinding (its own name, now resolving to 127.0.0.1: the Host
    header gives it away) or by a cross-site request (the Origin header does). Both get a 403
    unless the name is loopback, the configured `host`, or listed in `allowed_hosts` (Host) /
    `cors_origins` (Origin). A keyed daemon checks the key instead; a page cannot send it.

    CORS: a preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed
    origin is answered here; responses to allowed origins carry Access-Control-Allow-Origin.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keyed: bool,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        cors_origins: Iterable[str] = (),
    ):
        self.app = app
        self.keyed = keyed
        self.hosts = {host_name(h) for h in allowed_hosts if h.strip()}
        bind = host_name(bind_host)
        self.wildcard_bind = bind_host.strip() in WILDCARD_BINDS
        if not self.wildcard_bind:
            self.hosts.add(bind)
        self.origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip()}
        self.any_origin = "*" in self.origins  # refused with a key set (Settings)

    def host_allowed(self, name: str) -> bool:
        if is_loopback_name(name) or name in self.hosts:
            return True
        # Bound to every address: a client may use any of this device's IPs. An IP literal is
        # never a rebinding name (the attack needs a DNS name the page's origin also has).
        return self.wildcard_bind and _ip(name) is not None

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (sandboxed frames, file://) and anything odd
        return self.host_allowed(host_name(parts.netloc))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin", b"").decode("latin-1") or None
        if not self.keyed:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host and not self.host_allowed(host):  # HTTP/1.0 without Host: the socket's
                await self._refuse(
                    scope, send, f"Host {host!r} is not served here", "host_not_allowed"
                )
                return
            if origin is not None and not self.origin_allowed(origin):
                await self._refuse(
                    scope, send, f"Origin {origin[:200]!r} is not allowed", "origin_not_allowed"
                )
                return
        allowed = origin is not None and self.origin_allowed(origin)
        if scope["method"] == "OPTIONS" and origin and b"access-control-request-method" in headers:
            if not allowed:
                await self._refuse(
                    scope, send, f"Origin {origin[:200]!r} is not allowed", "origin_not_allowed"
                )
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [
                        *self._cors(origin),
                        (b"access-control-allow-methods", CORS_METHODS),
                        (b"access-control-allow-headers", CORS_HEADERS),
                        (b"access-control-max-age", b"600"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        if not allowed:
            await self.app(scope, receive, send)
            return

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self._cors(origin)]
            await send(message)

        await self.app(scope, receive, with_cors)

    @staticmethod
    def _cors(origin: str) -> list[tuple[bytes, bytes]]:
        # The origin echoed, never "*": a wildcard would let any page read keyed answers.
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    @staticmethod
    async def _refuse(scope: Scope, send: Send, message: str, code: str) -> None:
        exc = Forbidden(
            message + "; a key-less daemon answers only loopback names, `host`, "
            "`allowed_hosts` and `cors_origins`",
            code=code,
        )
        await _send_error(scope, send, 403, error_json(exc))


class BodyLimit:
    """Refuse bodies over `limit` bytes: by Content-Length up front, else while reading."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        timeout_s: float | None = None,
        streamed: tuple[str, ...] = (),
    ):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s  # the whole body must arrive within it (408 otherwise)
        # Path prefixes whose routes stream the body and bound it themselves (a blob upload
        # is a model file: gigabytes, for minutes).
        self.streamed = streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in ("GET", "HEAD", "OPTIONS")
            or (self.streamed and scope.get("path", "").startswith(self.streamed))
        ):
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLarge(
            f"request body exceeds the limit of {self.limit} bytes", param=None
        )
        length = dict(scope["headers"]).get(b"content-length")
        try:
            declared = int(length) if length is not None else 0
        except ValueError:
            declared = 0
        if declared > self.limit + DRAIN_MAX:  # not worth reading: answer and hang up
            await _send_error(scope, send, 413, error_json(too_large))
            return
        # Read the whole (bounded) body first; then replay it and pass the rest through. An
        # oversize body is read to its end (and dropped) before the 413, up to DRAIN_MAX, so
        # the client sees the answer instead of a connection reset mid-upload.
        chunks: list[bytes] = []
        size = 0

        async def read() -> bool:
            nonlocal size
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return False  # disconnected before the body was complete
                body = message.get("body", b"")
                size += len(body)
                more = message.get("more_body", False)
                if size > self.limit:
                    chunks.clear()
                    if size > self.limit + DRAIN_MAX:
                        break
                    continue
                chunks.append(body)
            return True

        try:
            # Before auth and before any route: a client that trickles its body would hold its
            # connection (and the request's memory) for as long as it liked.
            if not await asyncio.wait_for(read(), self.timeout_s):
                return
        except TimeoutError:
            timeout = RequestTimeout(
                f"request body not received within {self.timeout_s:g} s", param=None
            )
            await _send_error(scope, send, 408, error_json(timeout))  # connection: close
            return
        if size > self.limit:
            await _send_error(scope, send, 413, error_json(too_large))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestMetrics:
    """memspec_requests_total{endpoint, status}: endpoint is the route template, not the URL."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
