"""`memspec rpc-worker`: this device's compute served to a daemon over ggml's RPC protocol.

The protocol has no authentication and no encryption: whoever reaches the port can run graphs
on this device and read or write its buffers. So the worker binds loopback unless
`allow_remote` is given, for a link the operator trusts (docs/security.md)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from memspec.errors import DeviceUnavailable, InvalidRequest
from memspec.rpc import ggml
from memspec.rpc.endpoints import is_loopback

log = logging.getLogger("memspec.rpc")


def serve_worker(
    host: str,
    port: int,
    threads: int | None = None,
    cache_dir: Path | None = None,
    allow_remote: bool = False,
    on_listening: threading.Event | None = None,
) -> None:
    """Serve this device (its GPU if it has one, else its CPU) at host:port until SIGINT or
    SIGTERM. `cache_dir` keeps the tensors
    a daemon sent (by hash), so the next load of the same model skips the transfer."""
    if not is_loopback(host) and not allow_remote:
        raise InvalidRequest(
            f"refusing to serve ggml RPC on {host}: it has no authentication, anyone who reaches "
            "the port can use this device; bind 127.0.0.1, or pass --allow-remote on a trusted "
            "link (docs/security.md)",
            param="host",
        )
    if not 0 < port < 65536:
        raise InvalidRequest(f"port {port} is out of range", param="port")
    devices = ggml.serving_devices()
    n_threads = threads or os.cpu_count() or 1
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    endpoint = f"{host}:{port}"
    # ggml's accept loop never returns: it runs on a thread, and the main thread waits for a
    # signal (a C call holds it otherwise, and Ctrl-C would never be seen).
    done = threading.Event()
    failed = threading.Event()

    def run() -> None:
        ggml.start_server(endpoint, str(cache_dir) if cache_dir else None, n_threads, devices)
        failed.set()  # it returns only when it could not serve (e.g. the port is taken)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=run, name="ggml-rpc-server", daemon=True).start()
    log.info("rpc worker on %s: %d threads, cache %s", endpoint, n_threads, cache_dir or "off")
    if on_listening is not None:
        on_listening.set()
    done.wait()
    if failed.is_set():
        raise DeviceUnavailable(f"could not serve ggml RPC on {endpoint} (is the port taken?)")
