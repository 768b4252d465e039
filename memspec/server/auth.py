"""Bearer keys: `api_key` guards /v1, `admin_key` (else `api_key`) guards /admin.

No key configured means open, which the runner allows only on a loopback bind. Keys are
compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request
from pydantic import SecretStr

from memspec.config import Settings
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


def _check(request: Request, keys: list[SecretStr | None] | SecretStr | None, what: str) -> str:
    """The key the request was let in with ("" when no key is configured)."""
    if not isinstance(keys, list):
        keys = [keys]
    expected = [k.get_secret_value().strip().encode() for k in keys if configured(k)]
    if not expected:
        return ""
    given = _bearer(request)
    if given is None:
        raise Unauthorized(f"this endpoint needs the {what} key: Authorization: Bearer <key>")
    # Constant time over bytes (compare_digest refuses non-ASCII str); the key is stripped the
    # way the token is, so a key file's trailing newline does not lock everyone out. Every
    # key is compared, so the time says nothing of which one matched.
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes as sent.
    raw = given.encode("latin-1")
    matched = [hmac.compare_digest(raw, e) for e in expected]
    if not any(matched):
        raise Unauthorized(f"invalid {what} key")
    return given


def api_keys(settings: Settings) -> list[SecretStr | None]:
    return [settings.api_key, *settings.api_keys]


def fully_keyed(settings: Settings) -> bool:
    """Both /v1 and /admin need a key: a web page cannot use either (it has no key)."""
    v1 = any(configured(k) for k in api_keys(settings))
    admin = configured(settings.admin_key) or configured(settings.api_key)
    return bool(v1 and admin)


def cache_partition(key_id: str, salt: str | None) -> str:
    """Whose prefix cache a request may reuse: its key's and its `cache_salt`'s (vLLM's fix
    for CVE-2025-46570). Hashed: the key itself never reaches the engine."""
    if not key_id and not salt:
        return ""
    text = f"{key_id}\0{salt or ''}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()[:32]


def admin_key(settings_ctx: ServerContext) -> SecretStr | None:
    s = settings_ctx.settings
    return configured(s.admin_key) or configured(s.api_key)


async def require_api_key(request: Request, ctx: Ctx) -> None:
    given = _check(request, api_keys(ctx.settings), "API")
    # Only a digest goes further (the prefix cache's partition), never the key.
    request.state.key_id = hashlib.sha256(given.encode("latin-1")).hexdigest()[:32] if given else ""


async def require_admin_key(request: Request, ctx: Ctx) -> None:
    _check(request, admin_key(ctx), "admin")


def request_partition(request: Request, salt: str | None) -> str:
    """The prefix cache partition of a /v1 request (require_api_key ran first)."""
    return cache_partition(getattr(request.state, "key_id", ""), salt)
