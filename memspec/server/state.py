"""Settings tuned live through the admin API, persisted so that a restart keeps them.

One small JSON file, `<state_dir>/tuned.json` (state_dir defaults to <data_dir>/state; the
systemd unit uses /var/lib/memspec). Writes are atomic: a temporary file in the same directory,
fsync, os.replace, fsync of the directory, so a crash or kill -9 mid-write leaves the old or
the new file, never a torn one. At start the file is applied over env, TOML and defaults;
command-line flags still win.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from memspec.config import Settings
from memspec.errors import MemSpecError
from memspec.paths import data_dir

log = logging.getLogger("memspec.server")

# Tunables whose change rebuilds the runtime (a new context: its length, slots, cache types).
RELOAD_KEYS = (
    "n_ctx", "parallel", "kv_type_k", "kv_type_v", "draft_kv_type_k", "draft_kv_type_v",
    "flash_attn", "swa_full",
)  # fmt: skip
TUNABLE = ("budget", "policy", "k_max", "prefill_chunk", "context_overflow", *RELOAD_KEYS)
STATE_FILE = "tuned.json"
REJECTED_FILE = "tuned.rejected.json"


class StateWriteError(MemSpecError):
    """The tuned settings could not be written to disk."""


def state_path(settings: Settings | None = None, state_dir: Path | None = None) -> Path:
    base = state_dir or (settings.state_dir if settings is not None else None)
    return Path(base or data_dir() / "state") / STATE_FILE


def load_state(path: Path) -> dict[str, Any]:
    """The tuned settings, or {} when there are none; a corrupt file is set aside, not fatal."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("cannot read tuned settings %s: %s; using configured values", path, e)
        return {}
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        aside = path.with_suffix(".corrupt")
        log.warning("tuned settings %s unreadable (%s); moved to %s", path, e, aside)
        try:
            os.replace(path, aside)
        except OSError:
            pass
        return {}
    return {k: v for k, v in data.items() if k in TUNABLE}


def save_state(path: Path, values: dict[str, Any]) -> None:
    """Atomically replace the state file with `values` (raises StateWriteError on failure)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({k: values[k] for k in TUNABLE if k in values}, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise StateWriteError(
            f"could not persist tuned settings to {path}: {e.strerror or e}; nothing changed"
        ) from e


def reject_state(path: Path, keys: list[str] | None = None) -> Path | None:
    """Set aside tuned values the daemon could not start with, so the next start (and the next
    tune, which merges into the file) does not trip on them again: all of them (keys None) or
    only `keys`. A copy of the file as it was is kept beside it; returns that copy's path."""
    aside = path.with_name(REJECTED_FILE)
    try:
        raw = path.read_text()
    except OSError:
        return None
    try:
        tmp = aside.with_name(f".{aside.name}.{os.getpid()}.tmp")
        tmp.write_text(raw)
        os.replace(tmp, aside)
        if keys is None:
            path.unlink()
        else:
            kept = {k: v for k, v in load_state(path).items() if k not in keys}
            save_state(path, kept)
    except (OSError, StateWriteError) as e:
        log.warning("could not set the rejected tuned settings in %s aside: %s", path, e)
        return None
    return aside


def clear_state(path: Path) -> None:
    """No tuned settings any more (`memspec-ctl reset`): the configured ones apply at start."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise StateWriteError(f"could not remove tuned settings {path}: {e.strerror or e}") from e


# --- starts that never got ready ---------------------------------------------------------------
# A tune can kill the process outright (a budget over the unit's MemoryMax: the OOM killer, at
# every start), so no code of ours runs to undo it. Instead each start is counted in a small
# record beside the tuned file, with the tuned file's hash, and the count is dropped once the
# daemon is ready. A tuned file still in place after `limit` starts in a row that never got
# ready is moved aside at the next start; systemd's StartLimitBurst (5) leaves room for that.
STARTS_FILE = "starts.json"


def _starts_path(path: Path) -> Path:
    return path.with_name(STARTS_FILE)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def note_start(path: Path, limit: int) -> tuple[int, Path | None]:
    """Count this start against the tuned file at `path`: (unready starts before this one,
    where the file was moved aside or None). Never raises: a read-only state dir only loses
    the protection."""
    record_path = _starts_path(path)
    digest = _digest(path)
    if digest is None:  # nothing tuned: nothing to count
        start_ready(path)
        return 0, None
    try:
        record = json.loads(record_path.read_text())
        before = int(record["unready"]) if record.get("tuned") == digest else 0
    except (OSError, ValueError, KeyError, TypeError):
        before = 0
    if before >= limit:
        aside = reject_state(path)
        try:
            record_path.unlink(missing_ok=True)
        except OSError:
            pass
        return before, aside
    try:
        tmp = record_path.with_name(f".{record_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"tuned": digest, "unready": before + 1}) + "\n")
        os.replace(tmp, record_path)
    except OSError as e:
        log.warning("cannot record this start in %s: %s", record_path, e)
    return before, None


def start_ready(path: Path) -> None:
    """The daemon got ready with the tuned file in place: it is one it can start with."""
    try:
        _starts_path(path).unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot clear the start record beside %s: %s", path, e)
