"""Files the daemon fetches and serves: their SHA-256, remembered beside them, and a lock per
file so that fetches (and deletes) of one file take turns.

    sha256_file(path)                 # hex digest (a tqdm bar with progress=True)
    verified(path, sha256)            # checks once, then trusts the stamp while size and mtime hold
    recorded_sha256(path)             # the stamp's digest, if it is for the file as it is now
    with dest_lock(dest): ...         # one fetch/delete of `dest` at a time, across processes
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        path.open("rb") as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 {path.name}",
            disable=not progress,
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(1 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verified(path: Path, sha256: str, bars: bool = True) -> bool:
    """Whether `path` holds `sha256`. The check is remembered beside it by size and mtime, so
    that every set-up does not re-read a gigabyte."""
    if not path.is_file():
        return False
    stamp, identity = stamp_for(path, sha256)
    if stamp.is_file() and stamp.read_text().strip() == identity:
        return True
    if sha256_file(path, progress=bars and path.stat().st_size > 64 << 20) != sha256:
        return False
    stamp.write_text(identity + "\n")
    return True


def stamp_path(path: Path) -> Path:
    """Where a file's checked SHA-256 is remembered ("sha256 size mtime_ns")."""
    return path.with_name(path.name + ".sha256")


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 a fetch checked and remembered beside `path`, if the stamp is for the file
    as it is now (same size and mtime); None otherwise."""
    stamp = stamp_path(path)
    if not stamp.is_file():
        return None
    recorded = stamp.read_text().split()
    if len(recorded) == 3 and stamp_for(path, recorded[0])[1] == " ".join(recorded):
        return recorded[0]
    return None


def stamp_for(path: Path, sha256: str) -> tuple[Path, str]:
    """Where a file's check is remembered, and what it must say for the file as it is now."""
    st = path.stat()
    return stamp_path(path), f"{sha256} {st.st_size} {st.st_mtime_ns}"


def staging_dir(dest: Path) -> Path:
    """Where the whole parts of a split file wait for the rest (kept across a break)."""
    return dest.parent / ".fetch" / dest.name


@contextlib.contextmanager
def dest_lock(dest: Path) -> Iterator[None]:
    """Hold `dest`'s lock: fetches (and deletes) of one file take turns, across threads and
    processes (flock is per open file, so two threads of one process exclude each other too).
    The lock file stays: removing it would let a third party lock a new one meanwhile."""
    locks = dest.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{dest.name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
