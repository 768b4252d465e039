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

import fcntl
import hashlib
import json
import os
import re
import tempfile
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


class BlobWriter:
    """One blob written by streaming: `offset` bytes are already in `<blob>-partial` (send a
    Range request from there), `write` appends, `commit` checks and renames, `abort` keeps
    the partial for a later resume. Use it as a context manager: leaving without commit
    aborts.

    The partial is locked (flock) from open to commit or abort: a second writer of the same
    blob, in this process or another, waits for the first, then resumes from what it left (or
    finds the blob there). The SHA-256 is computed as the bytes are written (the resumed
    prefix read once, on the first write), so commit does not read the whole blob again."""

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

    def write(self, chunk: bytes) -> None:
        self._hashed().update(chunk)
        self._file.write(chunk)

    @property
    def written(self) -> int:
        """Bytes in the partial now (the resumed offset included)."""
        return self._file.tell()

    def commit(self) -> Path:
        """Check the whole partial's SHA-256; when it is the digest, rename it into place and
        return the blob's path; else delete it and raise BlobMismatch."""
        try:
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
