"""The models a daemon can serve: the configured target, and every other model GGUF it finds.

    catalog = ModelCatalog(settings)
    catalog.models()          # the configured target first, then the rest by name
    catalog.find("gemma3:270m")  # by any of its names; None if no model answers to it

A model is a GGUF in the models directory that is not a built draft (drafts carry a
`.build.json` sidecar), or one whose family is built (the configured target may itself be
built, as the testbed's F32 SmolLM2 is). Names are memspec.model_id's: Ollama's library name
where the family is known, else the file stem as an id; a second file with a name already taken
is served under its stem. The directory is read again on every call (cheap: a listing, and
each header read once per file version), so a model pulled while the daemon runs is servable
at once.

Only usable files are models: one bad file must not hide the others or fail a listing. A
candidate that is a directory or not a regular file, a symlink that leaves the models dir
(unless the follow_symlinks setting allows it), a header that memspec.drafts.gguf_header's
check_gguf refuses (no magic, truncated, tensors past the end) or that names no model shape,
or a file llama.cpp failed to load (`mark_bad`, from the engine) is kept in a bad table
instead, with its reason, until its size or mtime change:

    catalog.bad_models()      # [{"file", "name", "reason"}] for the admin status
    catalog.unusable("x")     # UnusableModelFile (422) when "x" names a bad file, else None
    catalog.mark_bad(path, "llama.cpp could not load it")

Beside the loose files, every model of an Ollama-layout store is served under Ollama's own name
(`llama3.2:1b`, `hf.co/u/r:Q4_K_M`, `myhost:5000/ns/name:tag`), its GGUF blob loaded in place:
memspec's own store (`<models dir>/store`: pulled and created models) and the user's Ollama
store, adopted read-only (memspec.ollama_store). What its manifest's other layers say is read
into `ServableModel.store` (memspec.store_model): default options, system prompt, license,
messages. A model whose layers memspec cannot honour (a projector, an adapter, tensors) is
listed, so a client sees it, but refused: `find` passes it over, `unusable` says why, and it is
in bad_models with the reason. A manifest that cannot be read, or whose GGUF blob is missing or
bad, is a bad model like a bad file. A store model's name wins over a loose file's (the loose
file is then served under its stem); memspec's own store wins over the adopted one.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from memspec.backends.chat import ChatTemplate, resolve_chat_template
from memspec.config import Settings
from memspec.drafts.family import family_dir
from memspec.drafts.gguf_header import check_gguf, open_header, scalar
from memspec.errors import ModelLoadError, UnusableModelFile
from memspec.memory.gguf_info import read_shape
from memspec.model_id import as_model_id, model_aliases, ollama_name, served_model_id
from memspec.ollama_name import OllamaName
from memspec.ollama_store import OllamaStore, adopted_store, own_store
from memspec.paths import models_dir, resolve_model_path
from memspec.store_model import StoreModel, read_store_model

log = logging.getLogger("memspec.catalog")

# What a chat template is resolved from (memspec.backends.chat.resolve_chat_template).
_TEMPLATE_KEYS = ("general.architecture", "general.name", "tokenizer.chat_template")


@dataclass(frozen=True)
class ServableModel:
    name: str  # what it is served as (/v1/models, /api/tags, every answer)
    path: Path
    aliases: frozenset[str]  # every name a request may use, `name` included
    default: bool  # the configured target: served when a request names no model
    family_built: bool  # its draft pool is built (data/families/<stem>/family.json)
    # A model of an Ollama-layout store: its manifest and what its layers say (None: a file).
    store: StoreModel | None = field(default=None, compare=False)

    @property
    def refused(self) -> str | None:
        """Why a listed model is not served (a layer memspec cannot honour); None: served."""
        return self.store.refused if self.store is not None else None


@dataclass(frozen=True)
class BadModelFile:
    """A models-dir file that is not served, and why."""

    file: str  # its name in the models dir
    name: str  # what it would be served as
    path: Path
    reason: str  # structural, never the file's content
    aliases: frozenset[str]  # the names a request may use for it (`name` included)
    refused: bool = False  # a listed store model whose layers are refused (not a bad file)

    def row(self) -> dict[str, Any]:
        return {"file": self.file, "name": self.name, "reason": self.reason}

    def error(self) -> UnusableModelFile:
        if self.refused:
            return UnusableModelFile(
                f"model {self.name} is not served: {self.reason}",
                param="model",
                code="model_layer_unsupported",
            )
        return UnusableModelFile(
            f"model file {self.file} is not a usable GGUF: {self.reason}", param="model"
        )


@dataclass(frozen=True)
class _Header:
    general_name: str | None
    metadata: dict[str, str]


_FileKey = tuple[str, int, int]  # (resolved path, size, mtime_ns): one version of a file
MAX_REASON = 200  # characters of a reason kept (a message quotes at most this much)


class ModelCatalog:
    def __init__(self, settings: Settings):
        self._settings = settings
        self._headers: dict[tuple[Path, int, int], _Header] = {}
        self._verdicts: dict[_FileKey, str | None] = {}  # file version -> problem (None: ok)
        self._marked: dict[_FileKey, str] = {}  # mark_bad: file version -> reason
        self._store_models: dict[_FileKey, StoreModel] = {}  # manifest version -> its model
        self._adopted_logged: tuple[Path, int] | None = None
        self._lock = threading.Lock()

    def use_settings(self, settings: Settings) -> None:
        """The settings now (a live tune replaces them; the target and model_name stay)."""
        self._settings = settings

    @property
    def default_path(self) -> Path:
        return resolve_model_path(self._settings.target)

    @property
    def default_name(self) -> str:
        return served_model_id(self._settings.model_name, self.default_path)

    def models(self) -> list[ServableModel]:
        """The configured target first, then every other usable model in the models dir by
        name, then the stores' models by name (bad files are left out: bad_models; refused
        store models are listed, with `refused` set)."""
        return self._scan()[0]

    def stores(self) -> list[OllamaStore]:
        """The Ollama-layout stores served: memspec's own, then the adopted one if any."""
        adopted = adopted_store(self._settings)
        return [own_store(), *([adopted] if adopted is not None else [])]

    def bad_models(self) -> list[dict[str, Any]]:
        """The models-dir files not served, each {"file", "name", "reason"} (admin status)."""
        return [b.row() for b in self._scan()[1]]

    def unusable(self, name: str | None) -> UnusableModelFile | None:
        """The error for a request naming a bad file (by the name it would be served as, its
        file name or stem, or NAME:latest); None when no bad file answers to `name`."""
        if not name:
            return None
        bad = self._scan()[1]
        found = _lookup(bad, name, str.__eq__) or _lookup(bad, name, _equal_fold)
        return found.error() if found is not None else None

    def mark_bad(self, path: Path, reason: str) -> None:
        """The engine could not load `path`: it is left out, with `reason`, until its size or
        mtime change (a fixed or replaced file is tried again)."""
        key = _file_key(Path(path))
        if key is not None:
            with self._lock:
                self._marked[key] = _clean(reason)

    def _scan(self) -> tuple[list[ServableModel], list[BadModelFile]]:
        default = self.default_path
        rows = [self._model(self.default_name, default, True)]
        taken = {rows[0].name}
        default_key = _file_key(default)
        bad: list[tuple[Path, str]] = []
        if default_key is not None and (marked := self._marked_reason(default_key)):
            bad.append((default, marked))  # still served as the default (it is configured)
        store_rows, store_bad = self._scan_stores(taken)
        taken |= {m.name for m in store_rows} | {b.name for b in store_bad}
        root = models_dir()
        paths = sorted(root.glob("*.gguf"))
        sources = _derived_from([default, *(p for p in paths if self._is_model(p))])
        for path in paths:
            if _same_file(path, default) or not self._is_model(path) or path.name in sources:
                continue
            problem = self._problem(path, root)
            if problem is not None:
                bad.append((path, problem))
                continue
            name = ollama_name(path)
            if name is None or name in taken:
                name = _tagged(as_model_id(path.stem) or path.stem)
            if name in taken:
                continue
            taken.add(name)
            rows.append(self._model(name, path, False))
        # A bad file's name never takes a good one's: good files are named first.
        bad_rows = []
        for path, reason in bad:
            if path is default:
                name = self.default_name
            elif (name := ollama_name(path)) is None or name in taken:
                name = as_model_id(path.stem) or path.stem
            taken.add(name)
            aliases = model_aliases(name, None, path)
            bad_rows.append(BadModelFile(path.name, name, path, reason, aliases))
        return rows + store_rows, bad_rows + store_bad

    def _scan_stores(self, taken: set[str]) -> tuple[list[ServableModel], list[BadModelFile]]:
        """Every manifest of the stores: served (refused ones too, flagged), or bad."""
        rows: list[ServableModel] = []
        bad: list[BadModelFile] = []
        seen = set(taken)
        for store in self.stores():
            names = store.names()
            self._log_store(store, len(names))
            for name in names:
                display = name.display
                aliases = _store_aliases(name)
                if display in taken:  # the configured target's name: it stays the target
                    mpath = store.manifest_path(name)
                    why = "its name is the configured target's (set model_name to free it)"
                    bad.append(
                        BadModelFile(
                            str(mpath.relative_to(store.root)), display, mpath, why, aliases
                        )
                    )
                    continue
                if display in seen:  # memspec's own store has it: that copy is served
                    continue
                seen.add(display)
                entry = self._store_model(store, name)
                mpath = store.manifest_path(name)
                file = str(mpath.relative_to(store.root))
                if isinstance(entry, str):
                    bad.append(BadModelFile(file, display, mpath, _clean(entry), aliases))
                    continue
                problem = self._problem(entry.model_path, None)
                if problem is not None:
                    bad.append(BadModelFile(file, display, entry.model_path, problem, aliases))
                    continue
                general = self._header(entry.model_path).general_name
                rows.append(
                    ServableModel(
                        name=display,
                        path=entry.model_path,
                        aliases=aliases | ({as_model_id(general)} - {""} if general else set()),
                        default=False,
                        family_built=(family_dir(entry.model_path) / "family.json").is_file(),
                        store=entry,
                    )
                )
                if entry.refused:
                    bad.append(
                        BadModelFile(file, display, entry.model_path, entry.refused, aliases, True)
                    )
        return sorted(rows, key=lambda m: m.name), bad

    def find(self, name: str | None, *, refused: bool = False) -> ServableModel | None:
        """The model a request names (None or "": the default); None if none answers to it.
        A refused store model answers only with `refused` (/api/show describes it; a request
        to run it gets `unusable`'s error). Names compare as Ollama's do, case-insensitively
        (`SmolLM2:135M` is `smollm2:135m`), an exact spelling first."""
        models = [m for m in self.models() if refused or m.refused is None]
        if not name:
            return models[0]
        # The default's aliases win a clash: it is first, and the file as configured keeps
        # meaning the target.
        found = _lookup(models, name, str.__eq__)
        if found is None and name in (self._settings.target, default_file(self._settings)):
            return models[0]
        return found or _lookup(models, name, _equal_fold)

    def chat_template(self, model: ServableModel) -> ChatTemplate:
        """The template the model renders chats with, from its header (no load): the
        chat_template setting applies to the configured target only."""
        setting = self._settings.chat_template if model.default else None
        return resolve_chat_template(setting, self._header(model.path).metadata, model.path.name)

    # --- internals ------------------------------------------------------------------------
    def _model(self, name: str, path: Path, default: bool) -> ServableModel:
        general = self._header(path).general_name if path.is_file() else None
        return ServableModel(
            name=name,
            path=path,
            aliases=model_aliases(name, general, path),
            default=default,
            family_built=(family_dir(path) / "family.json").is_file(),
        )

    def _is_model(self, path: Path) -> bool:
        built_draft = path.with_name(path.name + ".build.json").is_file()
        return not built_draft or (family_dir(path) / "family.json").is_file()

    def _problem(self, path: Path, root: Path | None) -> str | None:
        """Why the candidate `path` cannot be served (None: it can). Nothing is opened that
        is not a regular file inside the models dir (or a symlink the settings follow); a
        store's blob (`root` None) is where its manifest says, wherever that is."""
        if root is not None and path.is_symlink() and not self._settings.follow_symlinks:
            try:
                inside = path.resolve().is_relative_to(root.resolve())
            except (OSError, RuntimeError):  # a symlink loop
                return "a symlink that cannot be resolved"
            if not inside:
                return "a symlink that leaves the models dir (the follow_symlinks setting is off)"
        try:
            st = path.stat()
        except OSError:
            return "a broken symlink" if path.is_symlink() else "cannot be read"
        if stat.S_ISDIR(st.st_mode):
            return "a directory, not a file"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        marked = self._marked_reason(key)
        if marked is not None:
            return marked
        with self._lock:
            if key in self._verdicts:
                return self._verdicts[key]
        problem = _header_problem(path)
        with self._lock:
            self._verdicts[key] = problem
        return problem

    def _log_store(self, store: OllamaStore, count: int) -> None:
        """Say once which adopted store is served (and again when it changes)."""
        if store.writable:
            return
        with self._lock:
            if self._adopted_logged == (store.root, count):
                return
            self._adopted_logged = (store.root, count)
        manifests = store.manifests_dir
        if manifests.exists() and not os.access(manifests, os.R_OK | os.X_OK):
            log.warning(
                "the Ollama store at %s cannot be read by this user: its models are not served "
                "(give it read access, e.g. the ollama group)",
                store.root,
            )
            return
        log.info("serving the Ollama store at %s read-only: %d models", store.root, count)

    def _store_model(self, store: OllamaStore, name: OllamaName) -> StoreModel | str:
        """read_store_model, remembered per version of the manifest while its GGUF blob is
        there (a bad one is read again: a pull may be writing its blobs)."""
        key = _file_key(store.manifest_path(name))
        with self._lock:
            cached = self._store_models.get(key) if key is not None else None
        if cached is not None and cached.model_path.is_file():
            return cached
        entry = read_store_model(store, name)
        if key is not None and not isinstance(entry, str):
            with self._lock:
                self._store_models[key] = entry
        return entry

    def _marked_reason(self, key: _FileKey) -> str | None:
        with self._lock:
            return self._marked.get(key)

    def _header(self, path: Path) -> _Header:
        try:
            st = path.stat()
        except OSError:
            return _Header(None, {})
        key = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._headers.get(key)
        if cached is not None:
            return cached
        try:
            reader = open_header(path)
            values = {k: scalar(reader, k) for k in _TEMPLATE_KEYS}
        except ModelLoadError:
            values = {}
        meta = {k: str(v) for k, v in values.items() if v is not None}
        header = _Header(meta.get("general.name"), meta)
        with self._lock:
            self._headers[key] = header
        return header


def _tagged(name: str) -> str:
    """A listed name as Ollama lists every model: `name:tag` (`latest` when the file has none;
    the untagged name stays an alias)."""
    return name if ":" in name else f"{name}:latest"


def _derived_from(models: Iterable[Path]) -> set[str]:
    """The files other served models were made from (a family target quantized from the GGUF
    the testbed fetched): the same weights again, not a model of their own to list."""
    sources = set()
    for path in models:
        try:
            record = json.loads(path.with_name(path.name + ".build.json").read_text())
        except (OSError, ValueError):
            continue
        source = record.get("source") if isinstance(record, dict) else None
        if isinstance(source, str) and source != path.name:
            sources.add(source)
    return sources


def default_file(settings: Settings) -> str:
    return Path(settings.target).name


def _file_key(path: Path) -> _FileKey | None:
    try:
        st = path.stat()
        return str(path.resolve()), st.st_size, st.st_mtime_ns
    except (OSError, RuntimeError):
        return None


def _same_file(path: Path, other: Path) -> bool:
    try:
        return path.resolve() == other.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _header_problem(path: Path) -> str | None:
    """Why a regular file's header is not a servable model's (None: it is). check_gguf checks
    the structure within the file; the model shape is what every listing reads (/api/tags'
    details, the memory footprint), so a file without one is refused here, not there."""
    try:
        check_gguf(path)
    except ModelLoadError as e:
        # check_gguf's messages start "<file> is not a valid GGUF file: " (the reason follows)
        return _clean(e.message.partition(" is not a valid GGUF file: ")[2] or e.message)
    try:
        read_shape(path)
    except ModelLoadError as e:
        return _clean(f"no model shape in its header ({e.message.removeprefix(path.name + ': ')})")
    except Exception as e:  # assorted numpy/struct errors on odd values: a bad file, not a 500
        return _clean(f"its header cannot be read ({type(e).__name__})")
    return None


_Named = TypeVar("_Named", ServableModel, BadModelFile)


def _lookup(entries: list[_Named], name: str, same: Callable[[str, str], bool]) -> _Named | None:
    """The entry `name` names by `same`: its served name first, then any alias. Called as
    spelt, then with _equal_fold: Ollama compares names ignoring case (types/model/name.go,
    EqualFold), so a model pulled as `smollm2:135m` answers to `SmolLM2:135M`; listings keep
    each name as it is."""
    return next((e for e in entries if same(e.name, name)), None) or next(
        (e for e in entries if any(same(a, name) for a in e.aliases)), None
    )


def _equal_fold(a: str, b: str) -> bool:
    return a.casefold() == b.casefold()


def _store_aliases(name: OllamaName) -> frozenset[str]:
    """The names a request may use for a store model: Ollama's short form, its full one, and
    the short form less `:latest` (`llama3.2` for `llama3.2:latest`)."""
    names = {name.display, name.full, f"{name.host}/{name.namespace}/{name.model}:{name.tag}"}
    if name.tag == "latest":
        names.add(name.display.removesuffix(":latest"))
    return frozenset(names)


def _clean(reason: str) -> str:
    """One printable line of at most MAX_REASON characters: a reason may quote a header's
    key or value, never a file's raw bytes."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in reason)
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."
