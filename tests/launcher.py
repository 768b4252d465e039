"""The one way tests start a real daemon, and the tools to talk to it.

    start(tmp, "lookup", settings={"max_queue": 1}, env={...}, faults=True)
    with running(tmp, keys=True, shared=True) as daemon: ...

`memspec serve` runs in a subprocess on a free loopback port, its output in a log file shown on
failure. A preset (PRESETS) names the settings a kind of daemon starts with; `settings` adds to
them and is given as command-line flags (so it outranks tuned state, as an operator's flags
do); `env` sets the rest (MEMSPEC_* settings without a flag, NOTIFY_SOCKET, ...). The caller's
own MEMSPEC_* environment is dropped, but for the data dir: a developer's settings never leak
into a test daemon. `keys=True` sets the test API and admin keys.

`faults=True` runs tests/fault_daemon.py instead of the CLI: the same daemon, with faults
injected through EngineWorker's runtime_factory (that file lists them).

MEMSPEC_TEST_URL=http://HOST:PORT points the tests that need only *a* daemon (`shared=True`:
tests/server's and memspec-ctl's end-to-end tests) at one already running, instead of starting
one. Start it on the testbed target with MEMSPEC_API_KEY=$MEMSPEC_TEST_API_KEY and
MEMSPEC_ADMIN_KEY=$MEMSPEC_TEST_ADMIN_KEY (defaults: API_KEY, ADMIN_KEY below). Tests that
need the process itself (its logs, notify socket or state dir) then skip; those that need a
daemon configured their way (faults, limits, restarts) still start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from memspec.model_id import served_model_id
from memspec.paths import models_dir

ROOT = Path(__file__).resolve().parent.parent
FAULT_DAEMON = ROOT / "tests" / "fault_daemon.py"
TARGET_FILE = "smollm2-135m-f32.gguf"
# The id a test daemon serves its target as: worked out as the daemon does, from the file.
MODEL = served_model_id(None, TARGET_FILE)
API_KEY = os.environ.get("MEMSPEC_TEST_API_KEY", "sk-test-api-key")
ADMIN_KEY = os.environ.get("MEMSPEC_TEST_ADMIN_KEY", "test-admin-key")
EXTERNAL_URL = os.environ.get("MEMSPEC_TEST_URL", "").rstrip("/")
N_CTX = 1024
N_THREADS = 1  # the test box is shared; one thread per server keeps llama.cpp from spinning

PRESETS: dict[str, dict[str, Any]] = {
    # prompt-lookup and q4_0 resident, budget 2 GiB: the pool these tests were written for (the
    # product's default preloads the target's whole family: tests/engine/test_qwen_pair.py)
    "default": {"drafts": ["prompt-lookup", "q4_0"]},
    "lookup": {"drafts": ["prompt-lookup"]},  # no draft weights to load: the quickest start
}


# scripts/test.sh --quick: the tier that runs no model (the logic over stub backends, the
# HTTP surface's parsing, the configuration): every test that needs a model skips.
QUICK = os.environ.get("MEMSPEC_TEST_TIER") == "quick"


def require_models() -> None:
    if QUICK:
        pytest.skip("needs real models: scripts/test.sh runs it, --quick does not")


def require_testbed() -> None:
    require_models()
    if not (models_dir() / TARGET_FILE).is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)


# The testbed's model drafts (self-drafts of SmolLM2), which the session runtime preloads.
MODEL_DRAFTS = ["q8_0", "q4_0", "q2_k"]

# The second family's derived pool (memspec.drafts.family): what `drafts build --family gemma3`
# builds for Gemma 3 270M (its Q4_0/Q8_0 self-drafts are skipped: the target is already Q4).
GEMMA_DRAFTS = ["prompt-lookup", "q2_k", "datastore-ci"]


def require_gemma() -> Path:
    """The second family's target (Gemma 3 270M), fetched and its drafts built by
    `scripts/setup.sh --family gemma3` (scripts/test.sh turns that on)."""
    require_models()
    from memspec.drafts.family import family_dir
    from memspec.package_index import family_target

    target = family_target("gemma3")
    if not target.is_file() or not (family_dir(target) / "family.json").is_file():
        pytest.fail(
            f"Gemma family missing ({target}): run scripts/setup.sh --family gemma3",
            pytrace=False,
        )
    return target


# The Qwen2.5-Coder pair (`drafts build --family qwen2.5-coder`): the 1.5B target's family is its
# 0.5B sibling, prompt lookup and the datastores built from its own answers (its Q2_K
# self-draft is skipped: it would be no smaller than the sibling).
QWEN_SIBLING = "sibling-0.5b"
QWEN_DRAFTS = ["prompt-lookup", QWEN_SIBLING, "datastore-ci"]


def require_qwen() -> Path:
    """The Qwen2.5-Coder-1.5B target with its family built, by `scripts/setup.sh --family
    qwen2.5-coder` (scripts/test.sh turns that on)."""
    require_models()
    from memspec.drafts.family import family_dir
    from memspec.package_index import family_target

    target = family_target("qwen2.5-coder")
    if not target.is_file() or not (family_dir(target) / "family.json").is_file():
        pytest.fail(
            f"Qwen pair missing ({target}): run scripts/setup.sh --family qwen2.5-coder",
            pytrace=False,
        )
    return target


def plain_answer(target: Path | None, question: str, tokens: int, n_ctx: int = N_CTX) -> str:
    """A model's greedy chat answer, plain, with nothing else loaded (in this process): what
    the daemon must answer when it serves that model among others (`target` None: the
    testbed's default target)."""
    from memspec.config import Settings
    from memspec.engine.types import SamplingParams
    from memspec.runtime import Runtime

    extra = {"target": str(target)} if target is not None else {}
    rt = Runtime(
        Settings.load(drafts=[], n_ctx=n_ctx, n_threads=N_THREADS, **extra), calibrate_costs=False
    )
    try:
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": question}])
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        return rt.generate(prompt, params, draft="none").text
    finally:
        rt.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_flags(settings: dict[str, Any]) -> list[str]:
    """Settings as `memspec serve` flags: --name-with-dashes, lists comma-separated."""
    flags: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return flags


class Daemon:
    """One `memspec serve` subprocess (or, `proc` None, the one at MEMSPEC_TEST_URL)."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log: Path | None = None):
        self.url = url
        self.proc = proc
        self.log_path = log
        self.health_503_seen = False
        self.while_loading: dict | None = None  # what a test saw before ready

    @property
    def external(self) -> bool:
        return self.proc is None

    def require_own(self) -> None:
        if self.external:
            pytest.skip("needs a daemon the tests start (MEMSPEC_TEST_URL is set)")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
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

    def logs(self, tail: int | None = 6000) -> str:
        self.require_own()
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start(
    tmp: Path,
    preset: str = "default",
    *,
    settings: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    keys: bool = False,
    faults: bool = False,
) -> Daemon:
    """Start a daemon (not waiting for it: see Daemon.wait_ready). Tuned state goes to
    tmp/state unless env sets MEMSPEC_STATE_DIR."""
    require_testbed()
    port = free_port()
    chosen = {"host": "127.0.0.1", "port": port, "n_ctx": N_CTX, "n_threads": N_THREADS}
    chosen |= PRESETS[preset] | (settings or {})
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    if "MEMSPEC_DATA_DIR" in os.environ:
        full_env["MEMSPEC_DATA_DIR"] = os.environ["MEMSPEC_DATA_DIR"]
    full_env |= {"PYTHONPATH": str(ROOT), "MEMSPEC_STATE_DIR": str(tmp / "state")}
    # No background draft builds (memspec.draft_builds) unless a test asks: on the shared data
    # dir they would build families of every model there, on CPUs the tests share.
    full_env["MEMSPEC_BUILD_DRAFTS"] = "false"
    # A developer's own Ollama store ($OLLAMA_MODELS, ~/.ollama) never joins a test's models;
    # the store tests name theirs.
    full_env["MEMSPEC_OLLAMA_MODELS"] = "none"
    if keys:
        full_env |= {"MEMSPEC_API_KEY": API_KEY, "MEMSPEC_ADMIN_KEY": ADMIN_KEY}
    full_env |= env or {}
    if faults:  # serve()'s own arguments: the CLI cannot pass a runtime factory
        cmd = [sys.executable, str(FAULT_DAEMON), json.dumps(chosen)]
    else:
        cmd = [sys.executable, "-m", "memspec.cli", "serve", *as_flags(chosen)]
    log = tmp / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    return Daemon(f"http://127.0.0.1:{port}", proc, log)


@contextlib.contextmanager
def running(
    tmp: Path,
    preset: str = "default",
    *,
    shared: bool = False,
    ready_s: float = 180.0,
    **kw: Any,
) -> Iterator[Daemon]:
    """A ready daemon for the block, stopped after it. `shared`: the one at MEMSPEC_TEST_URL
    if that is set (start()'s other arguments are then ignored). `ready_s`: how long its start
    may take (the 1.5B target calibrates for minutes on a busy 2-core box)."""
    if shared and EXTERNAL_URL:
        yield Daemon(EXTERNAL_URL)
        return
    daemon = start(tmp, preset, **kw)
    try:
        daemon.wait_ready(ready_s)
        yield daemon
    finally:
        daemon.stop()


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
