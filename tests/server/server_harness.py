"""Test harness: real `memspec serve` subprocesses, a real sd_notify socket, raw HTTP streams.

MEMSPEC_DATA_DIR is left as it is (the testbed models); tuned state goes to a temp dir.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memspec.paths import models_dir

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = "smollm2-135m"
API_KEY = "sk-test-api-key"
ADMIN_KEY = "test-admin-key"
N_CTX = 1024
N_THREADS = 1  # the test box is shared; one thread per server keeps llama.cpp from spinning


TARGET_FILE = "smollm2-135m-f32.gguf"
FAULT_SERVE = HERE / "fault_serve.py"


def require_testbed() -> None:
    if not (models_dir() / TARGET_FILE).is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotifySocket:
    """An AF_UNIX datagram socket standing in for systemd: collects every notification."""

    def __init__(self, path: str):
        self.address = path  # "@name" for the abstract namespace
        bind_to = "\0" + path[1:] if path.startswith("@") else path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []  # (monotonic time, one assignment)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            for line in data.decode().splitlines():
                self.messages.append((now, line))

    def lines(self) -> list[str]:
        return [m for _, m in self.messages]

    def times(self, line: str) -> list[float]:
        return [t for t, m in self.messages if m == line]

    def wait_for(self, line: str, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = self.times(line)
            if hits:
                return hits[0]
            time.sleep(0.05)
        raise AssertionError(f"no {line!r} notification in {timeout}s; got {self.lines()}")

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)


class ServerProcess:
    """One `memspec serve` subprocess; stdout+stderr go to a log file shown on failure."""

    def __init__(
        self,
        tmp: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        script: Path | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable]
        cmd += [str(script)] if script else ["-m", "memspec.cli", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--n-ctx", str(N_CTX)]
        cmd += ["--n-threads", str(N_THREADS), *(args or [])]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        full_env.setdefault("MEMSPEC_STATE_DIR", str(tmp / "state"))
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.health_503_seen = False
        self.while_loading: dict | None = None  # what a test saw before ready

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.logs()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
                self.health_503_seen |= r.status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def sse_events(raw: bytes) -> list[dict | str]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    out: list[dict | str] = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class RawStream:
    """An HTTP request on a bare socket: read some of the answer, then hang up at will."""

    def __init__(self, url: str, path: str, body: dict, headers: dict[str, str] | None = None):
        host, port = url.removeprefix("http://").split(":")
        raw = json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Type: application/json",
            f"Content-Length: {len(raw)}",
            *[f"{k}: {v}" for k, v in (headers or {}).items()],
        ]
        self.sock = socket.create_connection((host, int(port)), timeout=300)
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + raw)
        self.data = b""

    def read_until(self, marker: bytes, timeout: float = 120.0) -> bytes:
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while marker not in self.data and time.monotonic() < deadline:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.data += chunk
        return self.data

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
