"""Pull and push Ollama models over the distribution v2 API (any registry that speaks it: the
Ollama library, Hugging Face's GGUF repos, a private `docker-registry`).

    pull(parse("smollm2:135m"), store, emit)                 # into an OllamaStore
    push("myhost:5000/me/smollm2:135m", insecure, emit)      # from memspec's own store

A name resolves as Ollama's (memspec.ollama_name): `NAME` is
`https://registry.ollama.ai/v2/library/NAME/manifests/latest`, `host[:port]/ns/name:tag` is
that host's `/v2/ns/name/...`, `hf.co/user/repo:Q4_K_M` is Hugging Face's. `insecure` speaks
http, as Ollama's flag; a name spelled `http://...` without it is refused, as Ollama does.

Wire behaviour follows Ollama's server (server/images.go, download.go, upload.go) and the
distribution spec:
- the manifest is asked for by `Accept` (the docker v2 manifest media type) and stored as the
  registry sent it, so its SHA-256 is the digest the registry and `ollama list` show;
- each blob is streamed by digest into OllamaStore.open_blob_writer, a buffer at a time (never
  whole in memory): read with the standard library's client (readinto, a MiB at a time) on
  this thread while the writer's threads hash and append the buffers before it, which keeps a
  pull near curl's speed; the writer checks its SHA-256 before the rename, and a blob that
  does not match is deleted and the pull fails saying so; a connection that breaks mid-blob
  is resumed with `Range` from the bytes already written (a few tries, then the pull fails and
  the next pull resumes from the same partial file);
- a 401 with `WWW-Authenticate: Bearer realm=...,service=...,scope=...` fetches a token from the
  realm (with Basic credentials when there are some) and retries; `Basic` (an htpasswd
  registry) retries with the credentials. Credentials come from the caller (the pull body's
  `username`/`password`, as Ollama's old API) or MEMSPEC_REGISTRY_USERNAME /
  MEMSPEC_REGISTRY_PASSWORD, and are never logged or echoed in an error;
- progress is Ollama's NDJSON: "pulling manifest", one "pulling <12 hex>" per layer with
  `digest`, `total`, `completed` (zero fields left out, as Go's omitempty), "verifying sha256
  digest", "writing manifest", "success"; a push: "retrieving manifest", "pushing <12 hex>"
  per layer (HEAD first: a blob the registry has is not sent again), "pushing manifest",
  "success".
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from memspec import ollama_name
from memspec.errors import MemSpecError
from memspec.files import dest_lock
from memspec.ollama_name import OllamaName
from memspec.ollama_store import MANIFEST_MEDIA_TYPE, BlobMismatch, Layer, Manifest, OllamaStore

Emit = Callable[[dict[str, Any]], None]

# What Ollama answers when a registry has no such model (PullModel: "pull model manifest: " +
# os.ErrNotExist); clients and scripts match on it.
NOT_FOUND = "pull model manifest: file does not exist"
# Ollama's words for a blob whose bytes are not its digest (server/images.go errDigestMismatch).
DIGEST_MISMATCH = "digest mismatch, file must be downloaded again"

CHUNK = 1 << 20  # bytes per hand-off to a pulled blob's writer, per read of a pushed one
RETRIES = 5  # tries per blob after a broken connection, each resuming with Range
USER_AGENT = "memspec (ollama-compatible)"


class PullError(MemSpecError):
    """A pull, push or delete that cannot be done; the message is what the client is told."""


class ModelNotFound(PullError):
    """The registry (or the store) has no model by that name."""


class PullCancelled(PullError):
    """Every client of a pull went away (the partial blob is kept for a resume)."""


class Unauthorized(PullError):
    """The registry refused the credentials (or wanted some and had none)."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)  # never in a repr, a log line or an error

    @classmethod
    def from_env(cls) -> Credentials | None:
        user = os.environ.get("MEMSPEC_REGISTRY_USERNAME")
        return cls(user, os.environ.get("MEMSPEC_REGISTRY_PASSWORD", "")) if user else None

    @classmethod
    def given(cls, username: str | None, password: str | None) -> Credentials | None:
        """The request's own (Ollama's username/password fields), else the environment's."""
        return cls(username, password or "") if username else cls.from_env()


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's roots, SSL_CERT_FILE), made once per process:
    loading the roots takes tens of ms, a tenth of a small model's whole pull on loopback."""
    return httpx.create_ssl_context()


@functools.cache
def _opener() -> urllib.request.OpenerDirector:
    """The standard library's opener for blob GETs: the environment's proxies, redirects, and
    the same TLS roots as httpx's."""
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=_tls()))


def _read_some(r: Any) -> str:
    """An error response's body, cut short (a registry's JSON error, for the message)."""
    try:
        raw = r.read(4096)
    except (OSError, http.client.HTTPException):
        return ""
    try:
        errors = json.loads(raw).get("errors") or []
        return "; ".join(f"{e.get('code', '')}: {e.get('message', '')}".strip(": ") for e in errors)
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace").strip()


def base_url(name: OllamaName, insecure: bool) -> str:
    """The registry's root for `name`: http when insecure (Ollama's flag), else its scheme."""
    if name.scheme == "http" and not insecure:
        raise PullError("insecure protocol http", param="insecure")  # Ollama's words
    return f"{'http' if insecure else name.scheme}://{name.host}"


def _layer_event(verb: str, digest: str, completed: int, total: int) -> dict[str, Any]:
    ev: dict[str, Any] = {"status": f"{verb} {digest[7:19]}", "digest": digest}
    if total:  # Go's omitempty: zero counters are not sent
        ev["total"] = total
    if completed:
        ev["completed"] = completed
    return ev


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """`Bearer realm="...",service="...",scope="..."` -> ("bearer", {realm, service, scope})."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    while rest:
        key, _, rest = rest.strip().partition("=")
        if rest.startswith('"'):
            value, _, rest = rest[1:].partition('"')
        else:
            value, _, rest = rest.partition(",")
        params[key.strip().lower()] = value
        rest = rest.lstrip(" ,")
    return scheme.lower(), params


def _registry_error(r: httpx.Response) -> str:
    """A registry's error body (`{"errors": [{"code", "message"}]}`) in one line."""
    try:
        errors = r.json().get("errors") or []
        text = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}".strip(": ") for e in errors)
    except (ValueError, AttributeError):
        text = r.text[:200].strip()
    return f"{r.status_code}: {text}" if text else f"{r.status_code} {r.reason_phrase}"


class RegistryClient:
    """One registry, one repository (`ns/model`): requests that authenticate as the registry
    asks (a token per scope, or Basic), over one pooled httpx client."""

    def __init__(
        self,
        name: OllamaName,
        *,
        insecure: bool = False,
        credentials: Credentials | None = None,
        timeout: float = 30.0,
    ):
        self.name = name
        self.root = base_url(name, insecure)
        self.repo = f"{self.root}/v2/{name.namespace}/{name.model}"
        self.credentials = credentials
        self._auth: str | None = None  # the Authorization header that worked last
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout, read=120.0),
            follow_redirects=True,  # blobs often live behind a redirect (a CDN, S3)
            verify=_tls(),
            headers={"User-Agent": USER_AGENT},
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- requests, authenticated on a 401 -----------------------------------------------

    def _login(self, r: httpx.Response) -> bool:
        """Answer a 401's challenge; False when there is nothing more to try."""
        scheme, params = _challenge(r.headers.get("www-authenticate", ""))
        if scheme == "basic":
            if self.credentials is None or (self._auth or "").startswith("Basic"):
                return False
            pair = f"{self.credentials.username}:{self.credentials.password}".encode()
            self._auth = f"Basic {base64.b64encode(pair).decode()}"
            return True
        if scheme != "bearer" or "realm" not in params:
            return False
        query = {k: params[k] for k in ("service", "scope") if k in params}
        auth = (self.credentials.username, self.credentials.password) if self.credentials else None
        try:
            t = self.http.get(params["realm"], params=query, auth=auth)
        except httpx.HTTPError as e:
            raise PullError(f"registry token {params['realm']}: {type(e).__name__}") from None
        if t.status_code != 200:
            return False
        body = t.json()
        token = body.get("token") or body.get("access_token")
        if not token or self._auth == f"Bearer {token}":
            return False
        self._auth = f"Bearer {token}"
        return True

    def send(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        content: Callable[[], Any] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One request, retried after each login a 401 asks for (a body is rebuilt by calling
        `content` again). A streamed response must be closed by the caller."""
        for _ in range(3):
            h = dict(headers or {})
            if self._auth:
                h["Authorization"] = self._auth
            req = self.http.build_request(
                method, url, headers=h, content=content() if content else None
            )
            r = self.http.send(req, stream=stream)
            if r.status_code != 401:
                return r
            r.read()
            r.close()
            if not self._login(r):
                break
        raise Unauthorized(f"{self.name.display}: unauthorized ({_registry_error(r)})")

    # --- pull ---------------------------------------------------------------------------

    def manifest(self) -> bytes:
        url = f"{self.repo}/manifests/{self.name.tag}"
        try:
            r = self.send("GET", url, headers={"Accept": MANIFEST_MEDIA_TYPE})
        except httpx.HTTPError as e:
            raise PullError(f"pull model manifest: {_why(e)}") from None
        if r.status_code == 404:
            raise ModelNotFound(NOT_FOUND, param="model", code="model_not_found")
        if r.status_code != 200:
            raise PullError(f"pull model manifest: {_registry_error(r)}")
        return r.content

    def download(
        self,
        layer: Layer,
        store: OllamaStore,
        emit: Emit,
        *,
        cancel: Any = None,
        every_s: float = 0.1,
    ) -> None:
        """Stream one blob into `store`, resuming with Range after a break; the writer checks
        its SHA-256 before the rename (BlobMismatch: deleted, the pull fails)."""
        broke = ""
        for _ in range(RETRIES + 1):
            writer = store.open_blob_writer(layer.digest)
            have = writer.offset
            try:
                if have < layer.size:
                    have = self._fetch_into(writer, layer, have, emit, cancel, every_s)
            except (httpx.TransportError, _ShortRead) as e:  # the network broke: resume
                writer.abort()  # the partial stays: the next try asks for the rest
                broke = _why(e)
                emit(_layer_event("pulling", layer.digest, have, layer.size))
                time.sleep(0.2)
                continue
            except BaseException:
                writer.abort()
                raise
            try:
                writer.commit()
            except BlobMismatch:
                raise PullError(
                    f"{DIGEST_MISMATCH}: {layer.digest}", code="digest_mismatch"
                ) from None
            emit(_layer_event("pulling", layer.digest, layer.size, layer.size))
            return
        raise PullError(f"pull {layer.digest[:19]}: the connection kept breaking ({broke})")

    def _fetch_into(
        self, writer: Any, layer: Layer, have: int, emit: Emit, cancel: Any, every_s: float
    ) -> int:
        url = f"{self.repo}/blobs/{layer.digest}"
        headers = {"Range": f"bytes={have}-"} if have else {}
        r = self._open_blob(url, headers)
        try:
            if r.status == 416:  # nothing past `have`: the file is whole (or too long)
                return have
            if r.status not in (200, 206):
                text = _read_some(r)
                raise PullError(f"pull {layer.digest[:19]}: {r.status}: {text}".rstrip(": "))
            skip = have if r.status == 200 else 0  # a registry that ignored the Range
            # The body is read a CHUNK at a time straight into a fresh buffer (readinto: the
            # socket's bytes copied once, the GIL released while they come), and each buffer
            # is handed to the writer, whose threads hash and write it while this one reads
            # the next: the CPU per byte stays close to curl's.
            last = 0.0
            while True:
                if cancel is not None and cancel.is_set():
                    raise PullCancelled("pull cancelled: every client went away")
                buf = bytearray(CHUNK)
                try:
                    n = r.readinto(buf)
                except (OSError, http.client.HTTPException) as e:
                    raise _ShortRead(_why(e)) from None  # a break: the resume asks for the rest
                if not n:
                    break
                view = memoryview(buf)[:n]
                if skip:
                    cut = min(skip, n)
                    view, skip = view[cut:], skip - cut
                    if not len(view):
                        continue
                writer.write(view)
                have += len(view)
                now = time.monotonic()  # progress at most every `every_s` (10/s)
                if now - last >= every_s:
                    last = now
                    emit(_layer_event("pulling", layer.digest, have, layer.size))
            if have < layer.size:
                raise _ShortRead(f"the stream ended at {have} of {layer.size} bytes")
            return have
        finally:
            r.close()

    def _open_blob(self, url: str, headers: dict[str, str]) -> Any:
        """GET a blob with the standard library's HTTP client (its response's readinto fills
        a buffer in C; httpx's iteration costs about three times the CPU per byte), logging in as a
        401 asks, as send() does. Redirects (a CDN, S3) are followed without the registry's
        Authorization (urllib keeps an unredirected header off the next host), and proxies
        come from the environment, as httpx's. A response of any status is returned; a
        connection that fails raises _ShortRead (retried with Range)."""
        for _ in range(3):
            req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **headers})
            if self._auth:
                req.add_unredirected_header("Authorization", self._auth)
            try:
                r = _opener().open(req, timeout=120.0)
            except urllib.error.HTTPError as e:
                r = e  # a response too: its status, headers and body
            except (OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", None)  # a URLError wraps the socket's error
                raise _ShortRead(_why(reason if isinstance(reason, BaseException) else e)) from None
            if r.status != 401:
                return r
            challenge = httpx.Response(401, headers=dict(r.headers.items()))
            _read_some(r)
            r.close()
            if not self._login(challenge):
                break
        raise Unauthorized(f"{self.name.display}: unauthorized (401 on the blob)")

    # --- push ---------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        r = self.send("HEAD", f"{self.repo}/blobs/{digest}")
        return r.status_code == 200

    def upload(self, layer: Layer, store: OllamaStore, emit: Emit, every_s: float = 0.1) -> None:
        """POST an upload session, PATCH the blob's bytes as one stream, PUT with the digest."""
        if self.has_blob(layer.digest):
            emit(_layer_event("pushing", layer.digest, layer.size, layer.size))
            return
        r = self.send("POST", f"{self.repo}/blobs/uploads/")
        if r.status_code != 202 or "location" not in r.headers:
            raise PullError(f"push {layer.digest[:19]}: {_registry_error(r)}")
        location = urllib.parse.urljoin(f"{self.repo}/", r.headers["location"])
        path = store.blob_path(layer.digest)

        def body() -> Iterator[bytes]:
            sent, last = 0, 0.0
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    sent += len(chunk)
                    now = time.monotonic()
                    if now - last >= every_s:
                        last = now
                        emit(_layer_event("pushing", layer.digest, sent, layer.size))
                    yield chunk

        r = self.send(
            "PATCH",
            location,
            headers={"Content-Type": "application/octet-stream"},
            content=body,
        )
        if r.status_code not in (202, 204):
            raise PullError(f"push {layer.digest[:19]}: {_registry_error(r)}")
        location = urllib.parse.urljoin(location, r.headers.get("location", location))
        sep = "&" if "?" in location else "?"
        r = self.send("PUT", f"{location}{sep}digest={urllib.parse.quote(layer.digest)}")
        if r.status_code not in (201, 204):
            raise PullError(f"push {layer.digest[:19]}: {_registry_error(r)}")
        emit(_layer_event("pushing", layer.digest, layer.size, layer.size))

    def put_manifest(self, raw: bytes) -> None:
        r = self.send(
            "PUT",
            f"{self.repo}/manifests/{self.name.tag}",
            headers={"Content-Type": MANIFEST_MEDIA_TYPE},
            content=lambda: raw,
        )
        if r.status_code not in (200, 201, 202):
            raise PullError(f"push manifest: {_registry_error(r)}")


class _ShortRead(Exception):
    """A blob's stream ended cleanly before its size: treated as a broken connection."""


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def pull(
    name: OllamaName,
    store: OllamaStore,
    emit: Emit,
    *,
    insecure: bool = False,
    credentials: Credentials | None = None,
    cancel: Any = None,
    every_s: float = 0.1,
) -> Manifest:
    """Fetch `name`'s manifest and every blob it names into `store`, then write the manifest
    (last: a model is listed only when all its blobs are in place). Raises ModelNotFound
    (Ollama's "file does not exist"), Unauthorized, PullCancelled or PullError."""
    emit({"status": "pulling manifest"})
    with RegistryClient(name, insecure=insecure, credentials=credentials) as client:
        raw = client.manifest()
        try:
            manifest = Manifest.parse(raw)
        except MemSpecError as e:
            raise PullError(f"pull model manifest: {e.message}") from None
        for layer in (manifest.config, *manifest.layers):
            # Two pulls that share a blob (two tags of one model) take turns on it, across
            # threads and processes: one partial file has one writer.
            with dest_lock(store.root / f"blob-{layer.digest[7:]}"):
                if store.has_blob(layer.digest):
                    emit(_layer_event("pulling", layer.digest, layer.size, layer.size))
                    continue
                client.download(layer, store, emit, cancel=cancel, every_s=every_s)
    emit({"status": "verifying sha256 digest"})  # each blob was checked as it was committed
    if cancel is not None and cancel.is_set():
        raise PullCancelled("pull cancelled: every client went away")
    emit({"status": "writing manifest"})
    stored = store.write_manifest(name, raw)
    emit({"status": "success"})
    return stored


def push(
    name: str | OllamaName,
    insecure: bool,
    progress: Emit,
    *,
    store: OllamaStore | None = None,
    credentials: Credentials | None = None,
    every_s: float = 0.1,
) -> Manifest:
    """Push a model of memspec's own store (or `store`) to the registry its name names: each
    blob the registry lacks, then the manifest, byte for byte as stored."""
    from memspec.ollama_store import own_store

    parsed = name if isinstance(name, OllamaName) else ollama_name.parse(name)
    store = store or own_store()
    progress({"status": "retrieving manifest"})
    manifest = store.read_manifest(parsed)
    if manifest is None:
        raise ModelNotFound(f"model '{parsed.display}' not found", param="model")
    creds = credentials or Credentials.from_env()
    try:
        with RegistryClient(parsed, insecure=insecure, credentials=creds) as client:
            for layer in (manifest.config, *manifest.layers):
                client.upload(layer, store, progress, every_s)
            progress({"status": "pushing manifest"})
            client.put_manifest(manifest.raw)
    except httpx.HTTPError as e:
        raise PullError(f"push {parsed.display}: {_why(e)}") from None
    progress({"status": "success"})
    return manifest
