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
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                await _send_error(send, 413, error_json(too_large))
                return
        # Read the whole (bounded) body first; then replay it and pass the rest through.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # disconnected before the body was complete
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await _send_error(send, 413, error_json(too_large))
                return
            chunks.append(body)
            more = message.get("more_body", False)
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
