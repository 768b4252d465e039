"""The latency relay against a tiny echo server: bytes, latency not bandwidth, cut, pause, close."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from memspec_lab.relay import LatencyRelay

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 5.0  # every blocking client call is bounded, so a broken relay fails, not hangs


class EchoServer:
    """Echo every byte back; on the client's EOF, half-close back and drop the connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, name="echo-accept", daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._echo, args=(conn,), name="echo", daemon=True)
            self._threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._accept.join(TIMEOUT_S)


@pytest.fixture()
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def _connect(relay: LatencyRelay) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def _round_trip(sock: socket.socket, payload: bytes = b"ping") -> float:
    start = time.monotonic()
    sock.sendall(payload)
    assert _recv_exactly(sock, len(payload)) == payload
    return time.monotonic() - start


def _relay_threads(relay: LatencyRelay) -> list[str]:
    """The live threads of `relay`: it names them all relay-PORT-…."""
    return [t.name for t in threading.enumerate() if t.name.startswith(f"relay-{relay.port}-")]


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_bytes_pass_unchanged_both_ways(echo: EchoServer, delay_s: float) -> None:
    with LatencyRelay(echo.address, delay_s=delay_s) as relay:
        assert relay.address == f"127.0.0.1:{relay.port}"
        with _connect(relay) as sock:
            _round_trip(sock, b"hello")
            _round_trip(sock, bytes(range(256)))
            # 1 MB: send from a thread while reading, so neither side's buffers deadlock;
            # then half-close, and the echo server's half-close must come back through as EOF.
            payload = os.urandom(1 << 20)

            def send() -> None:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send)
            sender.start()
            received = bytearray()
            while data := sock.recv(65536):
                received += data
            sender.join(TIMEOUT_S)
            assert bytes(received) == payload


def test_latency_applies_each_way(echo: EchoServer) -> None:
    with LatencyRelay(echo.address, delay_s=0.05) as relay, _connect(relay) as sock:
        _round_trip(sock)  # connection set-up out of the way
        rtt = min(_round_trip(sock) for _ in range(3))
        assert 0.1 <= rtt < 0.5


def test_chunks_pipeline_latency_not_serialization(echo: EchoServer) -> None:
    """20 requests spaced out so each is its own chunk: ~one RTT in all, not 20."""
    n, size = 20, 16
    with LatencyRelay(echo.address, delay_s=0.05) as relay, _connect(relay) as sock:
        _round_trip(sock)
        requests = [bytes([i]) * size for i in range(n)]
        start = time.monotonic()
        for request in requests:
            sock.sendall(request)
            time.sleep(0.005)  # keep the chunks apart; a serializing relay would take ≥ 2 s
        assert _recv_exactly(sock, n * size) == b"".join(requests)
        elapsed = time.monotonic() - start
        assert 0.1 <= elapsed < 1.0


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_cut_resets_current_connections_and_accepts_new(echo: EchoServer, delay_s: float) -> None:
    with LatencyRelay(echo.address, delay_s=delay_s) as relay:
        with _connect(relay) as sock:
            _round_trip(sock)
            start = time.monotonic()
            relay.cut()
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - start < 1.0
        with _connect(relay) as sock:
            _round_trip(sock, b"after the cut")


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_pause_stalls_and_resume_delivers(echo: EchoServer, delay_s: float) -> None:
    with LatencyRelay(echo.address, delay_s=delay_s) as relay:
        with _connect(relay) as sock:
            _round_trip(sock)
            relay.pause()
            assert relay.paused
            sock.sendall(b"stalled")
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(16)
            # A connection opened while paused stalls too.
            with _connect(relay) as fresh:
                fresh.sendall(b"fresh")
                fresh.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    fresh.recv(16)
                relay.resume()
                assert not relay.paused
                fresh.settimeout(TIMEOUT_S)
                assert _recv_exactly(fresh, 5) == b"fresh"
            sock.settimeout(TIMEOUT_S)
            assert _recv_exactly(sock, 7) == b"stalled"


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_close_ends_connections_and_leaves_no_threads(echo: EchoServer, delay_s: float) -> None:
    relay = LatencyRelay(echo.address, delay_s=delay_s)
    relay.start()
    socks = [_connect(relay) for _ in range(3)]
    for sock in socks:
        _round_trip(sock)
    relay.pause()  # a writer blocked on the pause must still be woken by close()
    socks[0].sendall(b"in flight")
    assert _relay_threads(relay)
    start = time.monotonic()
    relay.close()
    assert time.monotonic() - start < 1.0
    assert _relay_threads(relay) == []
    for sock in socks:
        with sock:
            try:
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", relay.port), timeout=TIMEOUT_S).close()
    relay.close()  # idempotent


def test_finished_connections_release_their_threads(echo: EchoServer) -> None:
    with LatencyRelay(echo.address, delay_s=0.01) as relay:
        with _connect(relay) as sock:
            _round_trip(sock)
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b""  # the echo server's half-close came back through
        deadline = time.monotonic() + TIMEOUT_S
        while _relay_threads(relay) != [f"relay-{relay.port}-accept"]:
            assert time.monotonic() < deadline, _relay_threads(relay)
            time.sleep(0.01)
