"""Bearer keys: `api_key` guards /v1, `admin_key` (else `api_key`) guards /admin.

No key configured means open, which the runner allows only on a loopback bind. Keys are
compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import Unauthorized


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _check(request: Request, key: SecretStr | None, what: str) -> None:
    if key is None or not key.get_secret_value():
        return
    given = _bearer(request)
    if given is None:
        raise Unauthorized(f"this endpoint needs the {what} key: Authorization: Bearer <key>")
    if not hmac.compare_digest(given.encode(), key.get_secret_value().encode()):
        raise Unauthorized(f"invalid {what} key")


def admin_key(settings_ctx: ServerContext) -> SecretStr | None:
    s = settings_ctx.settings
    return s.admin_key if s.admin_key is not None else s.api_key


async def require_api_key(request: Request, ctx: Ctx) -> None:
    _check(request, ctx.settings.api_key, "API")


async def require_admin_key(request: Request, ctx: Ctx) -> None:
    _check(request, admin_key(ctx), "admin")
