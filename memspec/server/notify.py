"""systemd's notify protocol: READY=1, STOPPING=1, STATUS=..., WATCHDOG=1 on $NOTIFY_SOCKET.

A datagram of newline-separated assignments to the AF_UNIX socket systemd names in
$NOTIFY_SOCKET: a path, or an abstract-namespace name written with a leading '@'. Without the
variable (not run by systemd) every call is a no-op. The watchdog pings at a third of
$WATCHDOG_USEC, and only while `healthy()` says the engine thread beat recently, so a stuck
engine stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from memspec.config import systemd_env

log = logging.getLogger("memspec.server")


def _address(raw: str) -> str | None:
    if raw.startswith("@"):
        return "\0" + raw[1:]  # abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # vsock: and other transports are not supported


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = systemd_env() if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = _address(raw) if raw else None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET %r: unsupported address, not notifying", raw)
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and (not pid or pid == str(os.getpid())):
            try:
                self.watchdog_s = int(usec) / 1e6 if int(usec) > 0 else None
            except ValueError:
                log.warning("WATCHDOG_USEC %r is not an integer; no watchdog", usec)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send one datagram; False when not enabled or the socket is gone (never raises)."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(assignments).encode(), self.address)
            return True
        except OSError as e:
            log.warning("sd_notify %s failed: %s", assignments[0] if assignments else "", e)
            return False

    def ready(self, status: str = "serving") -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self, status: str = "shutting down") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    async def watchdog_loop(self, healthy: Callable[[float], bool]) -> None:
        """Ping every watchdog/3 seconds while healthy(stale_s) holds; runs until cancelled.

        stale_s is the whole watchdog interval: an engine silent for that long is stuck (a
        long prefill beats before and after), and systemd acts one interval after the last
        ping.
        """
        if self.watchdog_s is None or not self.enabled:
            return
        period = self.watchdog_s / 3
        while True:
            if healthy(self.watchdog_s):
                self.watchdog()
            await asyncio.sleep(period)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
