"""`memspec create NAME -f Modelfile`: what `ollama create` does, against a running daemon."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memspec.errors import MemSpecError
from memspec.ollama_store import file_digest

CREATE_HELP = """\
Make a model from a Modelfile (Ollama's: FROM, PARAMETER, SYSTEM, LICENSE, MESSAGE) on a running
daemon, as `ollama create` does: a FROM that is a local GGUF file is uploaded to the daemon as a
blob (POST /api/blobs, skipped when the daemon has it), anything else is a model name the daemon
knows; then POST /api/create writes the model into the daemon's own store, where it is served at
once. --quantize runs llama.cpp's quantizer on an F32/F16/BF16 model first. TEMPLATE and ADAPTER
are refused: the GGUF's own chat template is used, and LoRA adapters are not served. The daemon
is $MEMSPEC_URL (else http://127.0.0.1:8000); its admin key, if it has one, $MEMSPEC_ADMIN_KEY."""

DEFAULT_URL = "http://127.0.0.1:8000"


def _fail(message: str, status: int = 1) -> int:
    print(f"memspec: error: {message}", file=sys.stderr)
    return status


def _error_of(response: Any) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text or f"HTTP {response.status_code}"


def request_fields(text: str, base: Path) -> tuple[dict[str, Any], Path | None]:
    """The /api/create fields of a Modelfile, and the local GGUF its FROM names (relative to
    the Modelfile's directory), if it names a file that exists."""
    from memspec import modelfile

    mf = modelfile.parse(text)
    fields = modelfile.create_fields(mf)
    for warning in mf.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    source = fields.get("from", "")
    local = Path(source).expanduser()
    local = local if local.is_absolute() else base / local
    if modelfile.looks_like_path(source) or local.is_file():
        if not local.is_file():
            raise MemSpecError(f"FROM {source}: no such file ({local})")
        return fields, local
    return fields, None


def cmd_create(args: argparse.Namespace) -> int:
    import httpx

    from memspec.config import client_env

    env = client_env(DEFAULT_URL)
    url = (args.url or env["url"] or DEFAULT_URL).rstrip("/")
    headers = {"Authorization": f"Bearer {env['admin_key']}"} if env["admin_key"] else {}
    mf_path = Path(args.file)
    try:
        text = mf_path.read_text(encoding="utf-8")
    except OSError as e:
        return _fail(f"cannot read {mf_path}: {e.strerror or e}")
    try:
        fields, local = request_fields(text, mf_path.resolve().parent)
    except MemSpecError as e:
        return _fail(e.message)
    if "template" in fields or "adapters" in fields:
        which = "TEMPLATE" if "template" in fields else "ADAPTER"
        return _fail(f"{which} is not supported by memspec (the GGUF's own chat template is used)")
    body: dict[str, Any] = {"model": args.name, "stream": True, **fields}
    if args.quantize:
        body["quantize"] = args.quantize
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(60, read=None)) as c:
            if local is not None:
                print(f"gathering model components: {local.name}", file=sys.stderr)
                digest = file_digest(local)
                if c.head(f"/api/blobs/{digest}").status_code != 200:
                    print(f"copying file {digest}", file=sys.stderr)
                    with local.open("rb") as f:
                        r = c.post(f"/api/blobs/{digest}", content=f)
                    if r.status_code >= 400:
                        return _fail(_error_of(r))
                del body["from"]
                body["files"] = {local.name: digest}
            return _stream_create(c, body)
    except httpx.HTTPError as e:
        return _fail(f"cannot reach the daemon at {url}: {e}")
    except KeyboardInterrupt:
        return _fail("interrupted (the daemon finishes a create it has started)", 130)


def _stream_create(client: Any, body: dict[str, Any]) -> int:
    from tqdm import tqdm

    bar = None
    with client.stream("POST", "/api/create", json=body) as r:
        if r.status_code >= 400:
            r.read()
            return _fail(_error_of(r))
        for line in r.iter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            if "error" in event:
                if bar is not None:
                    bar.close()
                return _fail(event["error"])
            if "total" in event:
                if bar is None:
                    bar = tqdm(
                        total=event["total"], unit="B", unit_scale=True, desc=event["status"]
                    )
                bar.update(event.get("completed", 0) - bar.n)
                continue
            if bar is not None:
                bar.close()
                bar = None
            print(event.get("status", ""), file=sys.stderr)
    if bar is not None:
        bar.close()
    print(body["model"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "create",
        help="make a model from a Modelfile on a running daemon (as `ollama create`)",
        description=CREATE_HELP,
    )
    p.add_argument("name", help="the new model's Ollama name (name[:tag], ns/name:tag, ...)")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p.add_argument(
        "-q", "--quantize", help="quantize an F32/F16/BF16 model to this type (q4_K_M, q8_0, ...)"
    )
    p.add_argument("--url", help=f"the daemon (default: $MEMSPEC_URL or {DEFAULT_URL})")
    p.set_defaults(func=cmd_create)
