"""The rest of Ollama's route table (server/routes.go GenerateRoutes), so that no route an
Ollama client may call is a bare 404 here (docs/ollama.md, "Routes"):

- `HEAD /api/version` and `HEAD /api/tags`: the probes Ollama answers as its GETs, without a
  body (FastAPI adds no HEAD to a GET route). `HEAD /api/tags` is 503 while the models load,
  as its GET is.
- `GET /api/status`: Ollama's StatusHandler, `{"cloud": {"disabled": true, "source":
  "config"}}`. memspec is what Ollama is with its cloud turned off: it has no ollama.com
  account, sends nothing to ollama.com, and runs no remote (`:cloud`) model.
- ollama.com's routes are refused as Ollama refuses them with its cloud off (server/
  cloud_proxy.go, internal/cloud/policy.go DisabledError): 403 `{"error": "ollama cloud is
  disabled: <operation>"}` for `POST /api/me`, `POST /api/signout`, `DELETE
  /api/user/keys/:key`, `POST /api/experimental/web_search`, `POST
  /api/experimental/web_fetch` and `GET /api/experimental/model-recommendations`.
The key rules are the other Ollama routes': `/api/version` and `/api/status` are open (they
tell nothing), the rest take the API key.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from memspec.server.auth import require_api_key
from memspec.server.context import Ctx
from memspec.server.openai_api import served_model

router = APIRouter(tags=["ollama"], dependencies=[Depends(require_api_key)])
open_router = APIRouter(tags=["ollama"])

# Ollama's internal/cloud/policy.go: the prefix of every "cloud is off" refusal.
CLOUD_DISABLED = "ollama cloud is disabled"


def cloud_refusal(operation: str) -> JSONResponse:
    """Ollama's answer to an ollama.com route when its cloud is off: 403 with its words."""
    return JSONResponse({"error": f"{CLOUD_DISABLED}: {operation}"}, status_code=403)


@open_router.head("/api/version")
async def head_version() -> Response:
    return Response(status_code=200, media_type="application/json")


@router.head("/api/tags")
async def head_tags(ctx: Ctx) -> Response:
    served_model(ctx)  # NotReady (503) while loading, as GET /api/tags
    return Response(status_code=200, media_type="application/json")


@open_router.get("/api/status")
async def status() -> dict[str, Any]:
    return {"cloud": {"disabled": True, "source": "config"}}


@router.post("/api/me")
async def whoami() -> JSONResponse:
    return cloud_refusal("ollama.com account is unavailable")


@router.post("/api/signout")
async def signout() -> JSONResponse:
    return cloud_refusal("ollama.com account is unavailable")


@router.delete("/api/user/keys/{encoded_key}")
async def delete_key(encoded_key: str) -> JSONResponse:
    return cloud_refusal("ollama.com account is unavailable")


@router.post("/api/experimental/web_search")
async def web_search() -> JSONResponse:
    return cloud_refusal("web search is unavailable")  # Ollama's cloudErrWebSearchUnavailable


@router.post("/api/experimental/web_fetch")
async def web_fetch() -> JSONResponse:
    return cloud_refusal("web fetch is unavailable")  # Ollama's cloudErrWebFetchUnavailable


@router.get("/api/experimental/model-recommendations")
async def model_recommendations() -> JSONResponse:
    return cloud_refusal("model recommendations are unavailable")
