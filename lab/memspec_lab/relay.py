"""A TCP relay that adds a fixed one-way latency: a slow link between a daemon and RPC workers.

The kernel here has no `tc netem`, so tests and the RPC benchmark put this relay between the
daemon and each ggml RPC worker instead. Every chunk read from one side reaches the other side
`delay_s` after it was read, in order; chunks pipeline, so the relay models link latency, not
bandwidth. `cut()` emulates a link failure and `pause()` a worker that hangs.
"""

from __future__ import annotations

import itertools
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

_CHUNK = 64 * 1024
_CONNECT_TIMEOUT_S = 5.0
_JOIN_TIMEOUT_S = 2.0
_WILDCARDS = ("", "0.0.0.0")
# struct linger {l_onoff=1, l_linger=0}: close() then sends RST and drops unsent data.
_LINGER_RESET = struct.pack("ii", 1, 0)

# A chunk on its way: (when to deliver it, the bytes), or None once its source has closed.
_Chunks = queue.SimpleQueue[tuple[float, bytes] | None]


def _nodelay(sock: socket.socket) -> None:
    # Small RPC messages must not wait for Nagle's algorithm on top of the emulated latency.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # already closed or never connected: nothing left to shut


class _Conn:
    """One relayed connection: a client socket, an upstream socket, and a pump per direction."""

    def __init__(
        self, relay: LatencyRelay, client: socket.socket, upstream: socket.socket, name: str
    ) -> None:
        self._relay = relay
        self._client = client
        self._upstream = upstream
        self._name = name
        self.closed = False  # written under relay._cond, so waiters see it together with a notify
        self._lock = threading.Lock()
        self._open_directions = 2

    def start(self) -> None:
        directions = (
            (self._client, self._upstream, "up"),
            (self._upstream, self._client, "down"),
        )
        for src, dst, tag in directions:
            if self._relay.delay_s > 0:
                chunks: _Chunks = queue.SimpleQueue()
                self._relay._spawn(f"{self._name}-{tag}-read", self._read, src, chunks)
                self._relay._spawn(f"{self._name}-{tag}-write", self._write, chunks, dst)
            else:
                # No latency: one thread per direction that reads and writes, no queue, no clock.
                self._relay._spawn(f"{self._name}-{tag}", self._pump, src, dst)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                # Only take the lock while paused, so the unpaused path costs nothing extra.
                if self._relay._paused and not self._relay._wait_until(self, None):
                    return
                dst.sendall(data)
        except OSError:
            self.close(abort=True)  # a reset or a closed socket: the link is gone both ways
            return
        self._finish_direction(dst)

    def _read(self, src: socket.socket, chunks: _Chunks) -> None:
        try:
            while data := src.recv(_CHUNK):
                chunks.put((time.monotonic() + self._relay.delay_s, data))
        except OSError:
            self.close(abort=True)
        finally:
            chunks.put(None)  # always, so the writer never waits on a reader that has gone

    def _write(self, chunks: _Chunks, dst: socket.socket) -> None:
        while (item := chunks.get()) is not None:
            deadline, data = item
            if not self._relay._wait_until(self, deadline):
                return
            try:
                dst.sendall(data)
            except OSError:
                self.close(abort=True)
                return
        self._finish_direction(dst)

    def _finish_direction(self, dst: socket.socket) -> None:
        """The source sent EOF and everything before it is delivered: pass the half-close on."""
        _shutdown(dst, socket.SHUT_WR)
        with self._lock:
            self._open_directions -= 1
            last = self._open_directions == 0
        if last:
            self.close()

    def close(self, abort: bool = False) -> None:
        """Close both sockets; `abort` resets them (RST) instead of a clean FIN."""
        with self._relay._cond:
            if self.closed:
                return
            self.closed = True
            self._relay._cond.notify_all()  # wake this connection's writers waiting on a deadline
        for sock in (self._client, self._upstream):
            if abort:
                # Reset rather than a clean FIN, as a broken link would look to the peers.
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                except OSError:
                    pass
            # shutdown() first: it wakes the threads blocked in recv()/sendall() on this socket.
            _shutdown(sock, socket.SHUT_RDWR)
            sock.close()
        self._relay._forget(self)


class LatencyRelay:
    """Forward connections from a local port to `target`, `delay_s` late in each direction.

    Use as a context manager, or call `start()` and `close()`. Listens on IPv4.
    """

    def __init__(
        self,
        target: tuple[str, int],
        delay_s: float = 0.0,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target = target
        self.delay_s = delay_s
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._listener: socket.socket | None = None
        self._port: int | None = None  # kept after close(), for messages and tests
        self._closing = False
        self._paused = False
        self._cond = threading.Condition()  # guards _paused and every _Conn.closed
        self._lock = threading.Lock()  # guards _conns and _threads
        self._conns: set[_Conn] = set()
        self._threads: list[threading.Thread] = []
        self._accept_thread: threading.Thread | None = None
        self._ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Bind and listen (a free port when `listen_port` is 0), then accept in the background."""
        if self._listener is not None or self._closing:
            raise RuntimeError("LatencyRelay.start() called twice")
        self._listener = socket.create_server((self._listen_host, self._listen_port))
        self._port = self._listener.getsockname()[1]
        self._accept_thread = self._spawn(f"relay-{self.port}-accept", self._accept_loop)

    def close(self) -> None:
        """Stop accepting, close every open connection, and wait for the relay's threads."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._listener is not None:
            # On Linux shutdown() wakes the thread blocked in accept(); close() alone would not.
            _shutdown(self._listener, socket.SHUT_RDWR)
            self._listener.close()
        # Join the acceptor first so no connection is added or started behind cut()'s back.
        if self._accept_thread is not None:
            self._accept_thread.join(_JOIN_TIMEOUT_S)
        self.cut()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> LatencyRelay:
        if self._listener is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- address ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LatencyRelay is not started")
        return self._port

    @property
    def address(self) -> str:
        """`host:port` for clients (a wildcard listen host is reached on 127.0.0.1)."""
        host = "127.0.0.1" if self._listen_host in _WILDCARDS else self._listen_host
        return f"{host}:{self.port}"

    # -- faults -----------------------------------------------------------------------------

    def cut(self) -> None:
        """Reset every current connection (a link failure); new connections are still accepted."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close(abort=True)

    def pause(self) -> None:
        """Stop forwarding on all connections, new ones too, until `resume()` (a hung worker)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Forward again; chunks whose delay ran out while paused go at once, in order."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # -- internals --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            try:
                upstream = socket.create_connection(self.target, timeout=_CONNECT_TIMEOUT_S)
            except OSError:
                client.close()  # the target is down: the client sees its connection closed
                continue
            upstream.settimeout(None)
            _nodelay(client)
            _nodelay(upstream)
            conn = _Conn(self, client, upstream, f"relay-{self.port}-c{next(self._ids)}")
            with self._lock:
                closing = self._closing
                if not closing:
                    self._conns.add(conn)
            if closing:
                conn.close(abort=True)
                return
            conn.start()

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            # Drop finished threads so a long-lived relay does not accumulate them.
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _wait_until(self, conn: _Conn, deadline: float | None) -> bool:
        """Block until `deadline` (monotonic; None: now) has passed and the relay is not paused.

        False when `conn` was closed meanwhile. Waits on the condition, never spins.
        """
        with self._cond:
            while not conn.closed:
                if self._paused:
                    self._cond.wait()
                    continue
                remaining = 0.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return True
                self._cond.wait(remaining)
            return False
