"""A real distribution registry on loopback for the pull/push tests, and the tools around it.

    with running_registry(tmp, users={"alice": "s3cret"}) as reg:    # htpasswd auth, or none
        pushed = push_model(reg, "test/smollm2:q8", GGUF)              # plain httpx, Ollama's types
        reg.blob_file(pushed.model_digest)                            # its bytes in the storage
    with CuttingProxy("127.0.0.1", reg.port, cut_after=5 << 20) as proxy: ...

The registry is Debian's `docker-registry` (the CNCF distribution registry 2.8, installed by
scripts/setup.sh), started as `/usr/bin/docker-registry serve config.yml` on a free loopback
port with a temp storage dir; the tests skip, saying so, where the binary is absent.
`push_model` uploads a GGUF the way Ollama's push does (blobs, then a manifest with Ollama's
media types), with nothing of memspec's, so a pull through memspec is checked against bytes
memspec did not write. CuttingProxy is the one injected fault: a TCP proxy that drops a
connection after N bytes from the registry, as a network break mid-blob would.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from memspec.ollama_store import file_digest
from tests.launcher import free_port

REGISTRY_BIN = Path("/usr/bin/docker-registry")
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
MODEL_TYPE = "application/vnd.ollama.image.model"
PARAMS_TYPE = "application/vnd.ollama.image.params"


def require_registry() -> None:
    if not REGISTRY_BIN.is_file():
        pytest.skip(
            f"{REGISTRY_BIN} is absent: `apt-get install docker-registry` (scripts/setup.sh "
            "installs it) to run the registry tests"
        )


def _bcrypt(password: str) -> str:
    """An htpasswd bcrypt hash through the system's libcrypt (no Python bcrypt needed)."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt.restype = ctypes.c_char_p
    alphabet = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    salt = "".join(secrets.choice(alphabet) for _ in range(21)) + "u"
    out = lib.crypt(password.encode(), f"$2b$05${salt}".encode())
    if not out or not out.startswith(b"$2"):
        pytest.skip("libcrypt here has no bcrypt: cannot write an htpasswd file")
    return out.decode()


@dataclass
class Registry:
    port: int
    storage: Path
    proc: subprocess.Popen
    log: Path
    users: dict[str, str]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def auth(self) -> httpx.BasicAuth | None:
        if not self.users:
            return None
        user, password = next(iter(self.users.items()))
        return httpx.BasicAuth(user, password)

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes."""
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def running_registry(tmp: Path, users: dict[str, str] | None = None) -> Iterator[Registry]:
    """A registry serving `tmp/storage` on a free loopback port; htpasswd auth for `users`."""
    require_registry()
    port, storage = free_port(), tmp / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    config = [
        "version: 0.1",
        "log:",
        "  level: warn",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {storage}",
        "  delete:",
        "    enabled: true",
        "  cache:",
        "    blobdescriptor: inmemory",
        "http:",
        f"  addr: 127.0.0.1:{port}",
        f"  secret: {secrets.token_hex(16)}",
    ]
    if users:
        htpasswd = tmp / "htpasswd"
        htpasswd.write_text("".join(f"{u}:{_bcrypt(p)}\n" for u, p in users.items()))
        config += ["auth:", "  htpasswd:", "    realm: memspec-test", f"    path: {htpasswd}"]
    (tmp / "config.yml").write_text("\n".join(config) + "\n")
    log = tmp / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(REGISTRY_BIN), "serve", str(tmp / "config.yml")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
    reg = Registry(port, storage, proc, log, dict(users or {}))
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"docker-registry exited {proc.returncode}:\n{reg.logs()}")
            try:
                if httpx.get(f"{reg.url}/v2/", timeout=2).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"docker-registry not up in 30 s:\n{reg.logs()}")
            time.sleep(0.1)
        yield reg
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# --- pushing a model as Ollama does, with plain httpx --------------------------------------


@dataclass(frozen=True)
class Pushed:
    repo: str  # ns/model
    tag: str
    manifest: bytes
    model_digest: str
    digests: tuple[str, ...]  # every blob: config, model, then the rest

    @property
    def manifest_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()


def _upload(http: httpx.Client, base: str, repo: str, digest: str, body: bytes | Path) -> None:
    if http.head(f"{base}/v2/{repo}/blobs/{digest}").status_code == 200:
        return
    r = http.post(f"{base}/v2/{repo}/blobs/uploads/")
    assert r.status_code == 202, r.text
    location = httpx.URL(base).join(r.headers["location"])
    if isinstance(body, Path):
        path = body

        def stream() -> Iterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        content = stream()
    else:
        content = body
    r = http.put(location.copy_merge_params({"digest": digest}), content=content)
    assert r.status_code == 201, r.text


def push_model(
    reg: Registry,
    name: str,
    gguf: Path,
    *,
    params: dict | None = None,
    base: str | None = None,
) -> Pushed:
    """Push `gguf` to `reg` as Ollama model `ns/model:tag`: its config blob, the model layer
    (and a params layer when given), then the manifest with Ollama's media types."""
    repo, _, tag = name.rpartition(":")
    base = base or reg.url
    layers: list[tuple[str, str, int, bytes | Path]] = [
        (MODEL_TYPE, file_digest(gguf), gguf.stat().st_size, gguf)
    ]
    if params is not None:
        raw = json.dumps(params).encode()
        layers.append((PARAMS_TYPE, "sha256:" + hashlib.sha256(raw).hexdigest(), len(raw), raw))
    config = json.dumps(
        {
            "model_format": "gguf",
            "model_family": "llama",
            "model_families": ["llama"],
            "model_type": "135M",
            "file_type": "Q8_0",
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [d for _, d, _, _ in layers]},
        }
    ).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    with httpx.Client(auth=reg.auth(), timeout=120) as http:
        _upload(http, base, repo, config_digest, config)
        for _, digest, _, body in layers:
            _upload(http, base, repo, digest, body)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
                "layers": [{"mediaType": t, "digest": d, "size": s} for t, d, s, _ in layers],
            }
        ).encode()
        r = http.put(
            f"{base}/v2/{repo}/manifests/{tag}",
            content=manifest,
            headers={"Content-Type": MANIFEST_TYPE},
        )
        assert r.status_code == 201, r.text
    digests = (config_digest, *(d for _, d, _, _ in layers))
    return Pushed(repo, tag, manifest, layers[0][1], digests)


# --- the injected fault: a connection cut mid-blob -----------------------------------------


class CuttingProxy:
    """A loopback TCP proxy to `host:port` that cuts a connection once `cut_after` bytes have
    come back on it from upstream, `cuts` times in all (the first connections to carry that
    much, however the client pools them; `pause_s`: a slow link besides).
    `requests` holds each connection's request head (to see the Range a resume sends)."""

    def __init__(
        self, host: str, port: int, *, cut_after: int, cuts: int = 1, pause_s: float = 0.0
    ):
        self.upstream = (host, port)
        self.pause_s = pause_s  # after each read from upstream: a slow link
        self.cut_after, self.cuts_left = cut_after, cuts
        self.requests: list[str] = []
        self.cut = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)

        def client_to_upstream() -> None:
            try:
                while data := client.recv(65536):
                    head = data.split(b"\r\n\r\n", 1)[0]
                    if head[:4] in (b"GET ", b"HEAD", b"POST", b"PUT ", b"PATC"):
                        with self.lock:
                            self.requests.append(head.decode("latin-1"))
                    upstream.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    upstream.shutdown(socket.SHUT_WR)

        threading.Thread(target=client_to_upstream, daemon=True).start()
        sent = 0
        try:
            while data := upstream.recv(65536):
                if sent + len(data) > self.cut_after:
                    with self.lock:  # one of the first `cuts` connections to get this far
                        cut = self.cuts_left > 0
                        self.cuts_left -= cut
                        self.cut += cut
                    if cut:
                        client.sendall(data[: self.cut_after - sent])
                        break
                client.sendall(data)
                sent += len(data)
                if self.pause_s:
                    time.sleep(self.pause_s)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.closed = True
        self.server.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- a loopback token server: Bearer auth as the Ollama library and Docker Hub ask for it ---


def _dechunked(rfile: Any) -> Iterator[bytes]:
    """A chunked request body's bytes (RFC 9112 7.1), read as they come; trailers skipped."""
    while True:
        size = int(rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return
        left = size
        while left:
            data = rfile.read(min(left, 1 << 20))
            if not data:
                raise ConnectionError("the chunked body ended early")
            left -= len(data)
            yield data
        rfile.readline()  # the CRLF after each chunk


def _sized(rfile: Any, length: int) -> Iterator[bytes]:
    while length > 0:
        data = rfile.read(min(length, 1 << 20))
        if not data:
            raise ConnectionError("the body ended early")
        length -= len(data)
        yield data


class TokenGate:
    """An HTTP front for a registry that wants a Bearer token, as token-auth registries do
    (Docker Hub, the Ollama library): a request without a token good for it gets 401
    `WWW-Authenticate: Bearer realm=<this>/token,service=...,scope=repository:<ns/model>:
    <actions>`, the actions `pull` for GET/HEAD and `pull,push` for POST/PATCH/PUT/DELETE;
    `GET /token?scope=...` with the right Basic credentials answers {"token": ...}, a token
    good for that scope only (`tokens_issued` counts them, `scopes` records what was asked).
    A request with a good token is passed to the registry, bodies streamed both ways (a
    chunked upload too), upload Locations rewritten to point here; `writes` records each
    write request that went through ("PATCH /v2/..."). With `blobs_at`, a blob GET with a good
    token is answered 307 to the same path there, as registries send blobs to a CDN."""

    def __init__(self, upstream: str, users: dict[str, str], *, blobs_at: str | None = None):
        import base64
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        gate = self
        self.upstream, self.users = upstream, users
        self.blobs_at = blobs_at  # a blob GET is redirected there (as to a CDN), if set
        self.scopes: list[str] = []
        self.writes: list[str] = []
        self.tokens: dict[str, str] = {}  # token -> the scope it was issued for
        self.tokens_issued = 0
        basics = {
            "Basic " + base64.b64encode(f"{u}:{p}".encode()).decode() for u, p in users.items()
        }

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _body(self) -> Iterator[bytes] | None:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    return _dechunked(self.rfile)
                length = int(self.headers.get("Content-Length") or 0)
                return _sized(self.rfile, length) if length else None

            def _allowed(self, repo: str, actions: str) -> bool:
                auth = self.headers.get("Authorization", "")
                scope = gate.tokens.get(auth.removeprefix("Bearer "), "")
                kind, _, rest = scope.partition(":")
                name, _, have = rest.rpartition(":")
                wanted = set(actions.split(","))
                return kind == "repository" and name == repo and wanted <= set(have.split(","))

            def _proxy(self) -> None:
                body = self._body()
                if self.path.startswith("/token"):
                    scope = httpx.URL(self.path).params.get("scope", "")
                    gate.scopes.append(scope)
                    if self.headers.get("Authorization") not in basics:
                        self._send(401, b'{"errors":[{"code":"DENIED"}]}', {})
                        return
                    token = secrets.token_hex(16)
                    gate.tokens[token] = scope
                    gate.tokens_issued += 1
                    self._send(200, json.dumps({"token": token}).encode(), {})
                    return
                repo = "/".join(self.path.split("?")[0].split("/")[2:4])
                actions = "pull" if self.command in ("GET", "HEAD") else "pull,push"
                if not self._allowed(repo, actions):
                    for _ in body or ():  # read it: the connection stays in step
                        pass
                    challenge = (
                        f'Bearer realm="http://{gate.host}/token",service="memspec-test",'
                        f'scope="repository:{repo}:{actions}"'
                    )
                    body_401 = b'{"errors":[{"code":"UNAUTHORIZED","message":"token required"}]}'
                    self._send(401, body_401, {"WWW-Authenticate": challenge})
                    return
                if self.command not in ("GET", "HEAD"):
                    gate.writes.append(f"{self.command} {self.path.split('?')[0]}")
                if gate.blobs_at and self.command == "GET" and "/blobs/sha256:" in self.path:
                    self._send(307, b"", {"Location": gate.blobs_at + self.path})
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() in ("range", "content-type", "content-length", "content-range")
                }
                headers["Accept"] = self.headers.get("Accept", "*/*")
                with httpx.stream(
                    self.command,
                    gate.upstream + self.path,
                    headers=headers,
                    content=body,
                    timeout=60,
                ) as r:
                    self.send_response(r.status_code)
                    for k in (
                        "Content-Type",
                        "Content-Length",
                        "Content-Range",
                        "Range",
                        "Location",
                        "Docker-Content-Digest",
                        "Docker-Upload-UUID",
                    ):
                        if k in r.headers:
                            value = r.headers[k]
                            if k == "Location":  # uploads continue through the gate
                                value = value.replace(gate.upstream, f"http://{gate.host}")
                            self.send_header(k, value)
                    self.end_headers()
                    if self.command != "HEAD":
                        for chunk in r.iter_raw():
                            self.wfile.write(chunk)

            do_GET = do_HEAD = do_POST = do_PATCH = do_PUT = do_DELETE = _proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> TokenGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
