"""ggml RPC workers on this machine, for benchmarks and tests: `memspec rpc-worker`
subprocesses on loopback, each behind a LatencyRelay that adds a link's one-way latency.

Why a relay on loopback, not network namespaces and `tc netem`: kernels without the netem
qdisc (this project's test machine: "Specified qdisc kind is unknown") cannot add latency to a
veth pair, so a relay is needed anyway; alone, it runs wherever the daemon does."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from memspec.rpc.relay import LatencyRelay

LINK = "loopback + LatencyRelay (memspec/rpc/relay.py)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalWorker:
    port: int
    log: Path
    threads: int = 1
    delay_s: float = 0.0
    proc: subprocess.Popen | None = None
    relay: LatencyRelay | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        """What a daemon connects to: the relay in front of the worker."""
        assert self.relay is not None, "start() first"
        return self.relay.address

    def start(self, timeout_s: float = 60.0) -> LocalWorker:
        """(Re)start the worker process on its port and wait until it accepts."""
        cmd = [sys.executable, "-m", "memspec.cli", "rpc-worker", "--port", str(self.port),
               "--threads", str(self.threads)]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rpc worker exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc worker not listening: {self.log_tail()}")
            time.sleep(0.1)
        if self.relay is None:
            self.relay = LatencyRelay(("127.0.0.1", self.port), self.delay_s)
            self.relay.start()
        return self

    def kill(self) -> None:
        """The worker dies (SIGKILL): its connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        if self.relay is not None:
            self.relay.close()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


@contextlib.contextmanager
def local_workers(
    logs: Path, n: int = 2, delay_s: float = 0.0, threads: int = 1
) -> Iterator[list[LocalWorker]]:
    """`n` workers on loopback behind relays adding `delay_s` each way; stopped after."""
    started: list[LocalWorker] = []
    try:
        for i in range(n):
            w = LocalWorker(free_port(), logs / f"rpc-worker-{i}.log", threads, delay_s)
            started.append(w.start())
        yield started
    finally:
        for w in started:
            w.close()
