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


def configured(key: SecretStr | None) -> SecretStr | None:
    """A key that is set and not blank; `MEMSPEC_ADMIN_KEY=` (empty) counts as no key, so it
    can neither open the admin API nor let a non-loopback bind through."""
    if key is None or not key.get_secret_value().strip():
        return None
    return key


def _check(request: Request, key: SecretStr | None, what: str) -> None:
    key = configured(key)
    if key is None:
        return
    given = _bearer(request)
    if given is None:
        raise Unauthorized(f"this endpoint needs the {what} key: Authorization: Bearer <key>")
    # Constant time over bytes (compare_digest refuses non-ASCII str); the key is stripped the
    # way the token is, so a key file's trailing newline does not lock everyone out.
    expected = key.get_secret_value().strip().encode()
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes as sent.
    if not hmac.compare_digest(given.encode("latin-1"), expected):
        raise Unauthorized(f"invalid {what} key")


def admin_key(settings_ctx: ServerContext) -> SecretStr | None:
    s = settings_ctx.settings
    return configured(s.admin_key) or configured(s.api_key)


async def require_api_key(request: Request, ctx: Ctx) -> None:
    _check(request, ctx.settings.api_key, "API")


async def require_admin_key(request: Request, ctx: Ctx) -> None:
    _check(request, admin_key(ctx), "admin")
