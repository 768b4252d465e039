"""ggml RPC workers on this machine, for benchmarks and tests: `memspec rpc-worker`
subprocesses, each behind a LatencyRelay that adds a link's one-way latency.

Where it can (root, `ip netns`), each worker runs in a network namespace of its own, joined to
this one by a veth pair on a test subnet of the run's own (10.2xx.i.0/24): a real network
stack between daemon and worker. Where namespaces are refused, the workers listen on loopback
instead, and `link` says which ran. Latency comes from the relay either way: `tc netem` would
put it on the veth pair, but kernels without the netem qdisc (this project's test machine:
"Specified qdisc kind is unknown") cannot, and the relay runs everywhere."""

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

from memspec_lab.relay import LatencyRelay

LOOPBACK = "loopback + LatencyRelay (memspec_lab/relay.py)"
NETNS = "network namespaces over veth pairs + LatencyRelay (memspec_lab/relay.py)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Netns:
    """A network namespace joined to this one by a veth pair: a worker host on a test link."""

    name: str
    host_addr: str  # this namespace's end
    addr: str  # the worker's end
    veth: str  # this namespace's end of the pair

    @classmethod
    def create(cls, index: int) -> Netns:
        """OSError (with ip's message) when namespaces are refused here."""
        tag = f"ms{os.getpid() % 100000}w{index}"  # interface names: 15 bytes at most
        net = f"10.{200 + os.getpid() % 50}.{index}"  # per run: two runs never share a subnet
        ns = cls(f"memspec-{tag}", f"{net}.1", f"{net}.2", f"{tag}h")
        steps = [
            ["ip", "netns", "add", ns.name],
            ["ip", "link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}n"],
            ["ip", "link", "set", f"{tag}n", "netns", ns.name],
            ["ip", "addr", "add", f"{ns.host_addr}/24", "dev", f"{tag}h"],
            ["ip", "link", "set", f"{tag}h", "up"],
            [
                "ip",
                "netns",
                "exec",
                ns.name,
                "ip",
                "addr",
                "add",
                f"{ns.addr}/24",
                "dev",
                f"{tag}n",
            ],
            ["ip", "netns", "exec", ns.name, "ip", "link", "set", f"{tag}n", "up"],
            ["ip", "netns", "exec", ns.name, "ip", "link", "set", "lo", "up"],
        ]
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired) as e:
                ns.delete()
                raise OSError(f"{' '.join(cmd)}: {e}") from e
            if done.returncode != 0:
                ns.delete()
                raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return ns

    def delete(self) -> None:
        """The namespace and its veth pair (deleting one end deletes both; the host end also
        stays behind when a step before moving the other end failed)."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=10)


@dataclass
class LocalWorker:
    port: int
    log: Path
    threads: int = 1
    delay_s: float = 0.0
    netns: Netns | None = None
    proc: subprocess.Popen | None = None
    relay: LatencyRelay | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return self.netns.addr if self.netns else "127.0.0.1"

    @property
    def endpoint(self) -> str:
        """What a daemon connects to: the relay in front of the worker."""
        assert self.relay is not None, "start() first"
        return self.relay.address

    def start(self, timeout_s: float = 60.0) -> LocalWorker:
        """(Re)start the worker process on its port and wait until it accepts."""
        cmd = [sys.executable, "-m", "memspec.cli", "rpc-worker", "--port", str(self.port),
               "--threads", str(self.threads), "--host", self.host]  # fmt: skip
        if self.netns is not None:  # its own host on the test link (no route beyond it)
            cmd = ["ip", "netns", "exec", self.netns.name, *cmd, "--allow-remote"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rpc worker exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc worker not listening: {self.log_tail()}")
            time.sleep(0.1)
        if self.relay is None:
            self.relay = LatencyRelay((self.host, self.port), self.delay_s)
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
        if self.netns is not None:
            self.netns.delete()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


@contextlib.contextmanager
def local_workers(
    logs: Path, n: int = 2, delay_s: float = 0.0, threads: int = 1, netns: bool = True
) -> Iterator[tuple[list[LocalWorker], str]]:
    """`n` workers behind relays adding `delay_s` each way, in namespaces of their own where
    this machine allows (`netns`), else on loopback; (workers, which link ran). Stopped after."""
    started: list[LocalWorker] = []
    link = NETNS if netns else LOOPBACK
    try:
        for i in range(n):
            ns = None
            if link == NETNS:
                try:
                    ns = Netns.create(i)
                except OSError as e:
                    link = f"{LOOPBACK}; namespaces refused here ({e})"
            w = LocalWorker(free_port(), logs / f"rpc-worker-{i}.log", threads, delay_s, ns)
            started.append(w)
            w.start()
        yield started, link
    finally:
        for w in started:
            w.close()
