"""Drafts for whatever arrives: every served model without a built family gets one, in the
background, while it serves at once with prompt lookup.

    builds = DraftBuilds(settings, catalog)   # the daemon makes one
    builds.start(ready=lambda: worker.ready)  # first look once the engine serves
    builds.rescan()                           # a pull or a create just finished
    builds.status()                           # [{"key", "models", "state", "reason", ...}]
    builds.close()                            # shutdown: the running build is stopped

What arrives: a model pulled or created (their routes call `rescan`), and whatever the catalog
lists (memspec.catalog: loose GGUFs, memspec's own store, the adopted Ollama store), looked at
once the engine is ready and every RESCAN_S after. A model needs a build unless its family is
built (`<data>/families/<key>/family.json`), it is the testbed's target (drafts/*.toml is its
pool), the configured target with a configured manifest_dir, or refused; a store model's key
is its blob's name (`sha256-<hex>`: memspec.drafts.family.slug), so two names of one blob share
one family, and what is built for it goes to memspec's data dir, never into a store.

A build is `memspec drafts build --target FILE` (memspec.recipes.family: the family plan_family
decides, the sibling found by scanning the catalog) in a child process at the lowest CPU
priority and idle I/O priority, one at a time, never on a request's path. Each build is in one
state:

    queued ──▶ building ──ok──▶ built
                   └──error──▶ failed (the child's last line kept as the reason)

The states are kept in `<data>/draft-builds.json` (written whole, renamed into place), so a
restart neither rebuilds what is built nor retries what failed (until the model's file
changes); a build stopped by a shutdown is queued again. A built family joins the model's
pool when its runtime next loads (memspec.runtime reads the pool's manifests at load; a
runtime's working set takes no new manifests while loaded): an idle model unloaded by
keep_alive or evicted comes back with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from memspec.catalog import ModelCatalog, ServableModel
from memspec.compat import StrEnum
from memspec.config import Settings
from memspec.drafts.compat import check_draft, fingerprint_of
from memspec.drafts.family import family_dir, is_testbed_target, pool_dir, slug
from memspec.drafts.manifest import load_manifests
from memspec.errors import MemSpecError
from memspec.paths import data_dir, models_dir

log = logging.getLogger(__name__)

RECORD_FILE = "draft-builds.json"
RESCAN_S = 30.0  # how often the catalog is looked at for a model that came by no route
STOP_S = 5.0  # a stopped build's grace before it is killed
MAX_REASON = 300  # characters of a failure's reason kept


class BuildState(StrEnum):
    QUEUED = "queued"
    BUILDING = "building"
    BUILT = "built"
    FAILED = "failed"


@dataclass
class Build:
    """One family's build: the model file it is for and where it stands."""

    key: str  # the family's directory name (slug of the file; a store blob's digest name)
    target: str  # the model's file
    models: list[str]  # the names it is served as
    state: BuildState
    version: list[int]  # the file's [size, mtime_ns] when last looked at
    reason: str = ""  # why it failed
    drafts: list[str] = field(default_factory=list)  # the ids built
    sibling: str | None = None  # the sibling found, if any
    updated_at: float = 0.0  # unix seconds

    def row(self) -> dict[str, Any]:
        return asdict(self) | {"state": str(self.state)}


def _version(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _family_report(key_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((key_dir / "family.json").read_text())
    except (OSError, ValueError):
        return None


class DraftBuilds:
    def __init__(
        self,
        settings: Settings | Callable[[], Settings],
        catalog: ModelCatalog,
        *,
        command: Callable[[Path, Settings], list[str]] | None = None,
        rescan_s: float = RESCAN_S,
    ):
        """`settings`: the settings, or how to read them now (a live tune replaces them).
        `command(target, settings)`: the child's argv (default: `memspec drafts build`)."""
        self._settings = settings if callable(settings) else (lambda: settings)
        self.catalog = catalog
        self._command = command or build_command
        self.rescan_s = rescan_s
        self.record_path = data_dir() / RECORD_FILE
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._builds: dict[str, Build] = self._load()
        self._child: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None

    # --- the daemon's side -------------------------------------------------------------------
    def start(self, ready: Callable[[], bool] = lambda: True) -> None:
        """The builder thread: it waits until `ready()` (the engine serves: a build never
        competes with the first load), then looks at the catalog."""
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="memspec-draft-builds", daemon=True
        )
        self._thread.start()

    def rescan(self) -> None:
        """Look at the catalog again now (a model was pulled or created)."""
        self._wake.set()

    def close(self, timeout: float = STOP_S + 5.0) -> None:
        """Stop: the running build's child is terminated (its state goes back to queued, and
        its finished drafts stay: a later build resumes), the thread ends."""
        self._closed.set()
        self._wake.set()
        self._stop_child()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> list[dict[str, Any]]:
        """Every build this daemon knows of, queued and building first."""
        order = list(BuildState)
        with self._lock:
            builds = sorted(self._builds.values(), key=lambda b: (order.index(b.state), b.key))
            return [b.row() for b in builds]

    def of(self, model: ServableModel) -> dict[str, Any]:
        """What /api/show says of a model's drafts: the ids its pool has built (and that speak
        its tokenizer), and its family's build (None: none is known)."""
        with self._lock:
            build = self._builds.get(slug(model.path))
            row = build.row() if build is not None else None
        settings = self._settings()
        configured = settings.manifest_dir if model.default else None
        return {"drafts": pool_drafts(model.path, configured), "build": row}

    # --- the builder thread ------------------------------------------------------------------
    def _run(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self._closed.wait(0.5):
                return
        while not self._closed.is_set():
            self._wake.clear()
            try:
                self._scan()
            except Exception:  # noqa: BLE001 - a bad listing must not end the builds
                log.exception("looking for models without drafts failed")
            if not any(self._build(b) for b in self._queued()):
                self._wake.wait(self.rescan_s)  # nothing to build, or others build it now

    def _scan(self) -> None:
        """Queue every served model that needs a family; note the ones that have one."""
        settings = self._settings()
        if not settings.build_drafts:
            return
        changed = False
        with self._lock:  # a model deleted since (its file gone) leaves the status
            for key, b in list(self._builds.items()):
                if b.state is not BuildState.BUILDING and not Path(b.target).exists():
                    del self._builds[key]
                    changed = True
        for m in self.catalog.models():
            if m.refused is not None or (m.default and settings.manifest_dir is not None):
                continue
            if is_testbed_target(m.path):
                continue
            version = _version(m.path)
            if version is None:
                continue
            key = slug(m.path)
            with self._lock:
                changed |= self._consider(key, m, version)
        if changed:
            self._save()

    def _consider(self, key: str, m: ServableModel, version: list[int]) -> bool:
        """Under the lock: whether the record changed."""
        b = self._builds.get(key)
        if b is not None and m.name not in b.models:
            b.models.append(m.name)
        report = _family_report(family_dir(m.path))
        if report is not None:  # built here, by an earlier daemon, or by `drafts build`
            if b is not None and b.state is BuildState.BUILT:
                return False
            self._builds[key] = Build(
                key, str(m.path), b.models if b else [m.name], BuildState.BUILT, version,
                drafts=[d["id"] for d in report.get("built", [])],
                sibling=next((s["id"] for s in report.get("siblings", [])), None),
                updated_at=time.time(),
            )  # fmt: skip
            return True
        if b is not None and b.state is BuildState.FAILED and b.version == version:
            return False  # remembered: a restart does not retry it, a new file does
        if b is not None and b.state in (BuildState.QUEUED, BuildState.BUILDING):
            return False
        self._builds[key] = Build(
            key, str(m.path), b.models if b else [m.name], BuildState.QUEUED, version,
            updated_at=time.time(),
        )  # fmt: skip
        log.info("drafts of %s queued (%s): it serves with prompt lookup meanwhile", m.name, key)
        return True

    def _queued(self) -> list[Build]:
        if not self._settings().build_drafts:
            return []
        with self._lock:
            return [b for b in self._builds.values() if b.state is BuildState.QUEUED]

    def _build(self, b: Build) -> bool:
        """Build `b`; False when another process builds that target now (`memspec pull
        --package-index`, another daemon on this data dir): it stays queued."""
        target = Path(b.target)
        lock = _try_lock(models_dir() / ".locks" / f"drafts-of-{target.name}.lock")
        if lock is None:
            return False
        try:
            self._build_locked(b, target)
        finally:
            lock.close()
        return True

    def _build_locked(self, b: Build, target: Path) -> None:
        with self._lock:
            b.state, b.reason, b.updated_at = BuildState.BUILDING, "", time.time()
        self._save()
        log.info("building the drafts of %s (%s) in the background", ", ".join(b.models), b.key)
        logs = data_dir() / "draft-builds"
        t0 = time.monotonic()
        log_path = logs / f"{b.key}.log"
        rc: int | None = None
        reason = ""
        try:
            logs.mkdir(parents=True, exist_ok=True)
            rc = self._run_child(self._command(target, self._settings()), log_path)
        except OSError as e:
            reason = f"the build could not start: {e}"
        if self._closed.is_set() and rc != 0:
            with self._lock:
                b.state, b.updated_at = BuildState.QUEUED, time.time()
            self._save()
            log.info("drafts of %s: build stopped by the shutdown; resumed next start", b.key)
            return
        report = _family_report(family_dir(target)) if rc == 0 else None
        with self._lock:
            b.updated_at = time.time()
            if report is not None:
                b.state = BuildState.BUILT
                b.drafts = [d["id"] for d in report.get("built", [])]
                b.sibling = next((s["id"] for s in report.get("siblings", [])), None)
            else:
                b.state = BuildState.FAILED
                if rc is not None:  # the CLI's last line says why
                    reason = _last_line(log_path) if rc != 0 else "it wrote no family.json"
                    reason = reason or f"exit status {rc}"
                b.reason = reason[:MAX_REASON]
        self._save()
        took = time.monotonic() - t0
        if b.state is BuildState.BUILT:
            log.info("drafts of %s built in %.1fs: %s", b.key, took, ", ".join(b.drafts) or "-")
        else:
            log.warning("drafts of %s failed after %.1fs: %s", b.key, took, b.reason)

    def _run_child(self, argv: list[str], log_path: Path) -> int:
        """The build in a child process at the lowest priority; its exit status."""
        env = os.environ | child_env(self._settings())
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=_ROOT,
                start_new_session=True,  # a terminal's ^C goes to the daemon, which stops it
            )  # fmt: skip
            _lower_priority(proc.pid)
            with self._lock:
                self._child = proc
            if self._closed.is_set():
                self._stop_child()
            try:
                return proc.wait()
            finally:
                with self._lock:
                    self._child = None

    def _stop_child(self) -> None:
        with self._lock:
            proc = self._child
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()

    # --- the record ---------------------------------------------------------------------------
    def _load(self) -> dict[str, Build]:
        try:
            raw = json.loads(self.record_path.read_text())
            rows = raw["builds"]
            builds = {k: Build(**(v | {"state": BuildState(v["state"])})) for k, v in rows.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s cannot be read (%s): the builds start afresh", self.record_path, e)
            return {}
        for b in builds.values():  # an earlier daemon stopped it mid-way: it resumes
            if b.state is BuildState.BUILDING:
                b.state = BuildState.QUEUED
        return builds

    def _save(self) -> None:
        """The record, written whole to a temporary file and renamed over the old one."""
        with self._lock:
            body = {"builds": {k: b.row() for k, b in self._builds.items()}}
        tmp = self.record_path.with_name(self.record_path.name + ".tmp")
        try:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            tmp.replace(self.record_path)
        except OSError as e:
            log.warning("cannot write %s: %s", self.record_path, e)


_ROOT = Path(__file__).resolve().parent.parent


def build_command(target: Path, settings: Settings) -> list[str]:
    """`memspec drafts build --target FILE [--only IDS]`: the family of one model."""
    argv = [sys.executable, "-m", "memspec.cli", "drafts", "build", "--target", str(target)]
    return argv + (["--only", *settings.build_drafts_only] if settings.build_drafts_only else [])


def child_env(settings: Settings) -> dict[str, str]:
    """What the child needs to see the daemon's data dir and catalog (the sibling is found
    there); its settings file is the daemon's alone."""
    env = {"MEMSPEC_DATA_DIR": str(data_dir())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    if settings.ollama_models is not None:
        env["MEMSPEC_OLLAMA_MODELS"] = settings.ollama_models
    env["MEMSPEC_FOLLOW_SYMLINKS"] = "true" if settings.follow_symlinks else "false"
    return env


def _try_lock(path: Path) -> IO[str] | None:
    """The build lock of a target (memspec.pull.build_drafts takes the same one), or None
    while another process holds it; closing the file lets it go."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a")
    except OSError:
        return open(os.devnull, "a")  # noqa: SIM115 - nowhere to lock: build anyway
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _lower_priority(pid: int) -> None:
    """Lowest CPU priority and idle I/O class: the engine's decoding comes first."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    with contextlib.suppress(Exception):  # psutil: Linux's ioprio; elsewhere a best effort
        import psutil

        idle = getattr(psutil, "IOPRIO_CLASS_IDLE", None)
        if idle is not None:
            psutil.Process(pid).ionice(idle)


def _last_line(path: Path) -> str:
    """The child's last line (the CLI's `memspec: error: ...`), as a reason."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1].removeprefix("memspec: error: ") if lines else ""


def pool_drafts(target: Path, configured: Path | None = None) -> list[str]:
    """The drafts a model's pool (`configured`: the manifest_dir setting) has built now, that
    speak its tokenizer: what its runtime preloads at its next load."""
    try:
        tokenizer = fingerprint_of(target)
        manifests = load_manifests(pool_dir(target, configured), {})
    except (MemSpecError, OSError, ValueError):
        return []
    out = []
    for m in manifests.values():
        if not m.is_built(models_dir()):
            continue
        try:
            if check_draft(tokenizer, m, models_dir()) is None:
                out.append(m.id)
        except (MemSpecError, OSError, ValueError):
            continue
    return out
