"""Helpers for the reliability tests: a private data dir the tests may damage, OpenAI error
checks, greedy requests, a watcher for files that must never be opened (inotify).

The daemons are real `memspec serve` processes started by tests/launcher.py; faults come from
tests/fault_daemon.py on purpose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import httpx
from launcher import ADMIN_KEY, API_KEY, MODEL, TARGET_FILE, Daemon, require_testbed

from memspec.paths import cache_dir, models_dir

# The shared hardened daemon (conftest.py): keys on both APIs, small limits.
HARDENED_N_CTX = 512
MAX_PROMPT_CHARS = 20000
MAX_BODY = 256 * 1024
CANARIES = ("canary.gguf", "canary", "canary.toml")
DRAFT_FILES = {
    "q4_0": "smollm2-135m-q4_0.gguf",
    "q2_k": "smollm2-135m-q2_k.gguf",
    "q8_0": "smollm2-135m-q8_0.gguf",
}


def make_data_dir(tmp: Path, copies: tuple[str, ...] = ()) -> Path:
    """A MEMSPEC_DATA_DIR of our own: the target and drafts as symlinks to the testbed (safe to
    delete or replace by rename), `copies` (draft ids) as real copies (safe to truncate or
    overwrite in place), and the calibration cache copied so start-up stays quick."""
    require_testbed()
    data = tmp / "data"
    models = data / "models"
    models.mkdir(parents=True)
    (models / TARGET_FILE).symlink_to(models_dir() / TARGET_FILE)
    for draft_id, name in DRAFT_FILES.items():
        src = models_dir() / name
        if not src.is_file():
            continue
        if draft_id in copies:
            shutil.copyfile(src, models / name)
        else:
            (models / name).symlink_to(src)
    if cache_dir().is_dir():
        shutil.copytree(cache_dir(), data / "cache", ignore=shutil.ignore_patterns("corpus"))
    return data


class Hardened:
    """The shared daemon, its data dir, the canary files nothing may open, its headers."""

    def __init__(self, srv: Daemon, data: Path, canaries: list[Path]):
        self.srv, self.url, self.data, self.canaries = srv, srv.url, data, canaries
        self.api = {"Authorization": f"Bearer {API_KEY}"}
        self.admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def logs(self) -> str:
        return self.srv.logs(None)


def assert_openai_error(
    resp: httpx.Response, status: int | tuple[int, ...], code: str | None = None
) -> dict[str, Any]:
    """The response is an OpenAI error: status as expected, exactly {message, type, param,
    code}, a non-empty one-line message; returns the error object."""
    statuses = (status,) if isinstance(status, int) else status
    assert resp.status_code in statuses, f"{resp.status_code}: {resp.text[:500]}"
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert "Traceback" not in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def completion(
    url: str,
    prompt: str,
    max_tokens: int = 12,
    draft: str = "none",
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> str:
    """One greedy completion (not streamed); its text."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "draft": draft,
    }
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def status(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(url + "/admin/status", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def draft_row(url: str, draft_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return next(d for d in status(url, headers)["drafts"] if d["id"] == draft_id)


class OpenWatch:
    """inotify on files that nothing may open: any IN_OPEN/IN_ACCESS on them is a traversal."""

    IN_ACCESS, IN_OPEN, IN_NONBLOCK = 0x1, 0x20, 0o4000

    def __init__(self, paths: list[Path]):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(self.IN_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names: dict[int, Path] = {}
        for p in paths:
            wd = libc.inotify_add_watch(self.fd, str(p).encode(), self.IN_OPEN | self.IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {p}")
            self.names[wd] = p

    def events(self) -> list[Path]:
        """Files opened or read since the last call."""
        out: list[Path] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                wd, _mask, _cookie, size = struct.unpack_from("iIII", buf, i)
                out.append(self.names.get(wd, Path("?")))
                i += 16 + size

    def close(self) -> None:
        os.close(self.fd)
