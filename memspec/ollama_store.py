"""Ollama's on-disk model store, read (and, for memspec's own one, written) in Ollama's layout.

    store = OllamaStore(Path("~/.ollama/models").expanduser(), writable=False)
    for name in store.names():                    # every manifest in the store
        manifest = store.read_manifest(name)      # its layers, and its digest (/api/tags)
        gguf = store.blob_path(manifest.layer(MEDIA_MODEL).digest)

The layout is Ollama's own (manifest/paths.go, manifest/manifest.go, types/model/name.go):
`<root>/manifests/<host>/<namespace>/<model>/<tag>` holds a JSON manifest (schemaVersion 2, a
`config` layer and `layers`, each {mediaType, digest, size}), and `<root>/blobs/sha256-<hex>`
holds each layer's bytes, named by their SHA-256. The digest Ollama lists for a model is the
SHA-256 of the manifest file's bytes, not of any layer.

Two stores use this module: memspec's own (`own_store()`, under the models dir: pulled and
created models, writable) and the user's Ollama store, adopted read-only (`adopted_store()`):
its blobs are served in place and nothing is ever written there (StoreReadOnly).

Writes are atomic: a blob streams into `<blob>-partial` (kept on a break, so a download
resumes from its size with a Range request; locked while written), is SHA-256-checked whole,
then renamed into place; a manifest is written to a temp file and renamed. A blob that does
not match its digest is deleted and BlobMismatch raised: no half-written or wrong file is ever
under a blob's name.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import queue
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memspec.config import Settings
from memspec.errors import InvalidRequest, MemSpecError
from memspec.ollama_name import OllamaName, parse
from memspec.paths import store_dir

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"
MEDIA_LICENSE = "application/vnd.ollama.image.license"

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CHUNK = 1 << 20  # bytes read at a time when hashing a file
MAX_MANIFEST = 4 << 20  # bytes: a manifest is a few hundred; anything this big is not one
# Buffers a blob writer's hash thread and file thread may each hold queued: the bound on the
# memory a fast producer can fill (write() waits for room), ~4 MiB each at the pull's 1 MiB.
PIPE_DEPTH = 4


class BlobMismatch(MemSpecError):
    """A blob's content does not hash to the digest it was named by (the partial is gone)."""


class StoreReadOnly(MemSpecError):
    """A write was asked of an adopted (read-only) store: memspec never writes into Ollama's."""


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # "sha256:<64 lowercase hex>"
    size: int


@dataclass(frozen=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...]
    raw: bytes  # the manifest file's bytes, as stored
    digest: str  # "sha256:<hex>" of raw: what Ollama lists as the model's digest

    @classmethod
    def parse(cls, raw: bytes) -> Manifest:
        """The manifest in `raw`; InvalidRequest when it is not one (bad JSON, no layers
        list, a layer without a sha256 digest or a size)."""
        if len(raw) > MAX_MANIFEST:
            raise InvalidRequest(f"a manifest is at most {MAX_MANIFEST} bytes", param="manifest")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the manifest is not JSON: {e}", param="manifest") from None
        if not isinstance(doc, dict):
            raise InvalidRequest("the manifest is not a JSON object", param="manifest")
        if doc.get("schemaVersion") != 2:
            raise InvalidRequest(
                f"the manifest's schemaVersion is {doc.get('schemaVersion')!r}, not 2",
                param="manifest",
            )
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise InvalidRequest("the manifest has no layers list", param="manifest")
        return cls(
            config=_layer(doc.get("config"), "config"),
            layers=tuple(_layer(item, f"layers[{i}]") for i, item in enumerate(layers)),
            raw=bytes(raw),
            digest="sha256:" + hashlib.sha256(raw).hexdigest(),
        )

    def layer(self, media_type: str) -> Layer | None:
        """The first layer of that media type (None: none)."""
        return next((x for x in self.layers if x.media_type == media_type), None)

    @property
    def size(self) -> int:
        """The model's size as Ollama lists it: every layer's and the config's."""
        return self.config.size + sum(x.size for x in self.layers)


def _layer(item: Any, where: str) -> Layer:
    if not isinstance(item, dict):
        raise InvalidRequest(f"the manifest's {where} is not an object", param="manifest")
    media_type, digest, size = item.get("mediaType"), item.get("digest"), item.get("size")
    if not isinstance(media_type, str) or not media_type:
        raise InvalidRequest(f"the manifest's {where} has no mediaType", param="manifest")
    if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
        raise InvalidRequest(
            f"the manifest's {where} digest {str(digest)[:80]!r} is not sha256:<64 hex>",
            param="manifest",
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidRequest(f"the manifest's {where} has no size", param="manifest")
    return Layer(media_type, digest, size)


def check_digest(digest: str) -> str:
    """`digest` if it is "sha256:<64 lowercase hex>" (Ollama also accepts "sha256-<hex>" in a
    path, which is normalised here); else InvalidRequest. Nothing else reaches a path."""
    if isinstance(digest, str) and digest.startswith("sha256-"):
        digest = "sha256:" + digest[len("sha256-") :]
    if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
        raise InvalidRequest(
            f"invalid digest {str(digest)[:80]!r}: expected sha256:<64 lowercase hex>",
            param="digest",
        )
    return digest


def file_digest(path: Path) -> str:
    """The "sha256:<hex>" of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's sync_file_range (not in `os`), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait
WRITEBACK_EVERY = 8 << 20  # bytes appended between two writeback starts


class _Stage:
    """One thread applying `fn` to buffers in the order given, from a bounded queue. The first
    error it meets is kept (later buffers are skipped) and raised to the producer at its next
    put() or at join()."""

    def __init__(self, fn: Callable[[tuple[bytes, ...]], Any], name: str):
        self._fn = fn
        self._q: queue.Queue[tuple[bytes, ...] | None] = queue.Queue(maxsize=PIPE_DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (buf := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._fn(buf)
                except BaseException as e:  # noqa: BLE001 - handed to the producer
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, buf: tuple[bytes, ...]) -> None:
        self._raise()
        self._q.put(buf)

    def join(self) -> None:
        """Wait until every buffer given is done (the thread ends), then raise its error."""
        self._q.put(None)
        self._thread.join()
        self._raise()


class BlobWriter:
    """One blob written by streaming: `offset` bytes are already in `<blob>-partial` (send a
    Range request from there), `write` appends, `commit` checks and renames, `abort` keeps
    the partial for a later resume. Use it as a context manager: leaving without commit
    aborts.

    The partial is locked (flock) from open to commit or abort: a second writer of the same
    blob, in this process or another, waits for the first, then resumes from what it left (or
    finds the blob there). The SHA-256 is computed as the bytes are written (the resumed
    prefix read once, on the first write), so commit does not read the whole blob again.

    write() hands each buffer to two threads, one hashing and one appending to the file, and
    returns once both have room in their bounded queues (PIPE_DEPTH buffers each): the
    caller's next read from the network overlaps this one's hash and write (hashlib and file
    writes release the GIL), which is what lets a pull keep up with curl. `written`, commit()
    and abort() wait for both threads first; an error of either (a full disk) is raised by the
    next write() or by commit()."""

    def __init__(self, target: Path, digest: str):
        self.target = target
        self.digest = digest
        self.partial = target.with_name(target.name + "-partial")
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        while True:  # lock the partial that is at the path now (not one renamed meanwhile)
            f = open(self.partial, "ab")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                if os.stat(self.partial).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()
        self._file = f
        self.offset = f.seek(0, os.SEEK_END)
        self._hash: Any = None  # sha256 of the bytes so far, once the prefix is read
        self._stages: tuple[_Stage, _Stage] | None = None  # started on the first write
        self._synced = self.offset  # bytes whose writeback has been started
        self._done = False

    def _hashed(self) -> Any:
        if self._hash is None:
            h = hashlib.sha256()
            with open(self.partial, "rb") as f:
                left = self.offset
                while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                    h.update(chunk)
                    left -= len(chunk)
            self._hash = h
        return self._hash

    def _hash_parts(self, parts: tuple[bytes, ...]) -> None:
        h = self._hashed()
        for part in parts:
            h.update(part)

    def _write_parts(self, parts: tuple[bytes, ...]) -> None:
        for part in parts:
            self._file.write(part)
        # Start the disk's writeback of what is appended as it goes, so the fsync before the
        # rename waits for the last few MiB, not the whole blob (curl's writes stay in the
        # page cache; ours must be on disk before the blob has its name).
        end = self._file.tell()
        if _SYNC_FILE_RANGE is not None and end - self._synced >= WRITEBACK_EVERY:
            self._file.flush()
            fd, start = self._file.fileno(), self._synced
            _SYNC_FILE_RANGE(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
            self._synced = end

    def write(self, data: bytes | tuple[bytes, ...]) -> None:
        """Queue `data` to be hashed and appended: bytes, or a tuple of them (a stream's reads
        as they came, not joined: no copy); not to be changed afterwards."""
        if self._stages is None:
            self._stages = (
                _Stage(self._hash_parts, f"hash {self.digest[7:19]}"),
                _Stage(self._write_parts, f"write {self.digest[7:19]}"),
            )
        parts = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
        for stage in self._stages:
            stage.put(parts)

    def _drain(self) -> None:
        """Wait for every queued buffer to be hashed and written (the threads end)."""
        stages, self._stages = self._stages, None
        if stages is None:
            return
        try:
            stages[0].join()
        finally:
            stages[1].join()

    @property
    def written(self) -> int:
        """Bytes in the partial now (the resumed offset included)."""
        self._drain()
        return self._file.tell()

    def commit(self) -> Path:
        """Check the whole partial's SHA-256; when it is the digest, rename it into place and
        return the blob's path; else delete it and raise BlobMismatch."""
        try:
            self._drain()
            self._file.flush()
            os.fsync(self._file.fileno())
            got = "sha256:" + self._hashed().hexdigest()
            if got != self.digest:
                self.partial.unlink(missing_ok=True)
                raise BlobMismatch(
                    f"blob {self.digest} does not match its content (sha256 {got}): deleted",
                    param="digest",
                )
            os.replace(self.partial, self.target)  # still locked: no writer appends meanwhile
            _fsync_dir(self.target.parent)
            return self.target
        finally:
            self._file.close()
            self._done = True

    def abort(self) -> None:
        """Stop, keeping the partial (a resume starts from its size)."""
        if not self._done:
            try:
                self._drain()  # what was read is kept: the resume asks for the rest
            except OSError:
                pass  # a write that failed: the partial holds what did get written
            finally:
                self._file.close()
                self._done = True

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class OllamaStore:
    def __init__(self, root: Path, *, writable: bool):
        self.root = Path(root)
        self.writable = writable

    def __repr__(self) -> str:
        return f"OllamaStore({str(self.root)!r}, writable={self.writable})"

    @property
    def manifests_dir(self) -> Path:
        return self.root / "manifests"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    def manifest_path(self, name: OllamaName) -> Path:
        """Ollama's Filepath: manifests/<host>/<namespace>/<model>/<tag>. The name's parts
        are parse()d (no '/', no leading '.'), so the path stays inside the store."""
        name = parse(name.full) if isinstance(name, OllamaName) else parse(str(name))
        return self.manifests_dir / name.host / name.namespace / name.model / name.tag

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / check_digest(digest).replace(":", "-", 1)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def open_blob_writer(self, digest: str) -> BlobWriter:
        self._writable("write a blob")
        return BlobWriter(self.blob_path(digest), check_digest(digest))

    def write_manifest(self, name: OllamaName, raw: bytes) -> Manifest:
        """Parse `raw` and write it as `name`'s manifest (a temp file renamed into place: a
        reader sees the old manifest or the new one, never half of one)."""
        self._writable("write a manifest")
        manifest = Manifest.parse(raw)
        path = self.manifest_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(manifest.raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        return manifest

    def read_manifest(self, name: OllamaName) -> Manifest | None:
        """The manifest stored for `name`; None when there is none. A file that is not a
        manifest raises InvalidRequest (the caller lists it as a bad model)."""
        path = self.manifest_path(name)
        try:
            if not path.is_file():
                return None
            if path.stat().st_size > MAX_MANIFEST:
                raise InvalidRequest(f"the manifest is over {MAX_MANIFEST} bytes")
            raw = path.read_bytes()
        except OSError:
            return None
        return Manifest.parse(raw)

    def names(self) -> list[OllamaName]:
        """Every manifest in the store, by name (Ollama's glob manifests/*/*/*/*: a file four
        levels down whose parts make a valid name; anything else is skipped, as Ollama does)."""
        found: list[OllamaName] = []
        try:
            paths = sorted(self.manifests_dir.glob("*/*/*/*"))
        except OSError:
            return found
        for path in paths:
            if path.name.startswith(".") or not path.is_file():
                continue
            host, namespace, model, tag = path.relative_to(self.manifests_dir).parts
            try:
                name = parse(f"{host}/{namespace}/{model}:{tag}")
            except InvalidRequest:
                continue
            if (name.host, name.namespace, name.model, name.tag) != (host, namespace, model, tag):
                continue  # e.g. a scheme-looking host: not a name Ollama would have written
            found.append(_explicit(name))
        return found

    def existing_name(self, name: OllamaName) -> OllamaName:
        """`name` spelled as this store spells it, names comparing ignoring case as Ollama's
        (server/routes.go getExistingName, which create, copy, delete and push all call):
        the exact spelling when it has a manifest; else the manifest whose whole name matches
        ignoring case (the first in sorted order); else each part (host, namespace, model,
        tag) replaced by the spelling some manifest uses for it, so a new name lands in the
        directories already there (`create Foo` beside `foo:v1` writes foo/...). A name that
        matches nothing is returned as given. Where Ollama picks among several spellings in
        a map's random order, this takes the first in sorted order."""
        try:
            if self.manifest_path(name).is_file():
                return name
        except OSError:
            pass
        names = self.names()
        key = _fold(name)
        for other in names:
            if _fold(other) == key:
                return _with_parts(name, other.host, other.namespace, other.model, other.tag)
        parts = [name.host, name.namespace, name.model, name.tag]
        for i in range(4):
            for other in names:
                theirs = (other.host, other.namespace, other.model, other.tag)[i]
                if theirs.casefold() == parts[i].casefold():
                    parts[i] = theirs
                    break
        return _with_parts(name, *parts)

    def delete(self, name: OllamaName) -> list[Path]:
        """Remove `name`'s manifest, then the blobs no other manifest in this store refers
        to; returns the paths removed (the manifest first). Nothing when there is none."""
        self._writable("delete a model")
        path = self.manifest_path(name)
        try:
            manifest = self.read_manifest(name)
        except InvalidRequest:
            manifest = None  # a broken manifest is deleted, its blobs left to their owners
        if not path.is_file():
            return []
        path.unlink()
        removed = [path]
        _prune_empty(path.parent, self.manifests_dir)
        if manifest is None:
            return removed
        in_use: set[str] = set()
        for other in self.names():
            try:
                m = self.read_manifest(other)
            except InvalidRequest:
                continue
            if m is not None:
                in_use.update(x.digest for x in (m.config, *m.layers))
        for layer in (manifest.config, *manifest.layers):
            if layer.digest in in_use:
                continue
            blob = self.blob_path(layer.digest)
            if blob.is_file():
                blob.unlink()
                removed.append(blob)
                in_use.add(layer.digest)  # listed twice in one manifest: removed once
        return removed

    def _writable(self, what: str) -> None:
        if not self.writable:
            raise StoreReadOnly(
                f"cannot {what} in {self.root}: it is the adopted Ollama store, which memspec "
                "only reads",
                param="model",
            )


def existing_name(name: OllamaName, *stores: OllamaStore) -> OllamaName:
    """`name` as the first of `stores` that has a manifest for it (ignoring case) spells it;
    else as the first store spells its parts (OllamaStore.existing_name). memspec has two
    stores where Ollama has one: its own, written, and the adopted one, read."""
    for store in stores:
        found = store.existing_name(name)
        try:
            if store.manifest_path(found).is_file():
                return found
        except OSError:
            continue
    return stores[0].existing_name(name) if stores else name


def _fold(name: OllamaName) -> tuple[str, ...]:
    return tuple(x.casefold() for x in (name.host, name.namespace, name.model, name.tag))


def _with_parts(name: OllamaName, host: str, namespace: str, model: str, tag: str) -> OllamaName:
    return OllamaName(host, namespace, model, tag, name.scheme, name.explicit_tag)


def _explicit(name: OllamaName) -> OllamaName:
    """The name with its tag marked as given (a stored name always has one)."""
    return OllamaName(name.host, name.namespace, name.model, name.tag, name.scheme, True)


def _prune_empty(directory: Path, stop: Path) -> None:
    """Remove `directory` and its parents up to (not including) `stop` while they are empty."""
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def own_store() -> OllamaStore:
    """memspec's own store (pulled and created models): `<models dir>/store`, writable."""
    return OllamaStore(store_dir(), writable=True)


def default_ollama_root() -> Path | None:
    """Where Ollama keeps its store: $OLLAMA_MODELS, else ~/.ollama/models, else the Linux
    service's /usr/share/ollama/.ollama/models; None when none of them is a directory."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return _expand(env)
    for candidate in (_expand("~/.ollama/models"), Path("/usr/share/ollama/.ollama/models")):
        try:
            if candidate is not None and candidate.is_dir():
                return candidate
        except OSError:  # a home the service may not look into
            continue
    return None


def _expand(path: str) -> Path | None:
    """`path` with `~` expanded; None when there is no home to expand it to."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return None


def adopted_store(settings: Settings) -> OllamaStore | None:
    """The user's Ollama store, read-only: the `ollama_models` setting's path ("none": no
    store), else the default places; None when there is none, or it is memspec's own."""
    setting = getattr(settings, "ollama_models", None)
    if setting is not None and str(setting).strip().lower() == "none":
        return None
    root = _expand(str(setting)) if setting else default_ollama_root()
    try:
        if root is None or not root.is_dir():
            return None
    except OSError:
        return None
    try:
        if root.resolve() == own_store().root.resolve():
            return None
    except OSError:
        return None
    return OllamaStore(root, writable=False)
