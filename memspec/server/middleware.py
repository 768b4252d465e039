"""ASGI middleware: request body limit (413) and per-endpoint request counting.

Pure ASGI (no BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memspec.server.errors import PayloadTooLarge, error_json
from memspec.server.metrics import Metrics

DRAIN_MAX = 16 << 20  # bytes of an oversize body read and dropped so the 413 gets through


async def _send_error(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": raw})


class BodyLimit:
    """Refuse bodies over `limit` bytes: by Content-Length up front, else while reading."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
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
            await _send_error(send, 413, error_json(too_large))
            return
        # Read the whole (bounded) body first; then replay it and pass the rest through. An
        # oversize body is read to its end (and dropped) before the 413, up to DRAIN_MAX, so
        # the client sees the answer instead of a connection reset mid-upload.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # disconnected before the body was complete
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > self.limit:
                chunks.clear()
                if size > self.limit + DRAIN_MAX:
                    break
                continue
            chunks.append(body)
        if size > self.limit:
            await _send_error(send, 413, error_json(too_large))
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
