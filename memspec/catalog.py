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
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from memspec.backends.chat import ChatTemplate, resolve_chat_template
from memspec.config import Settings
from memspec.drafts.family import family_dir
from memspec.drafts.gguf_header import open_header, scalar
from memspec.errors import ModelLoadError
from memspec.model_id import as_model_id, model_aliases, ollama_name, served_model_id
from memspec.paths import models_dir, resolve_model_path

# What a chat template is resolved from (memspec.backends.chat.resolve_chat_template).
_TEMPLATE_KEYS = ("general.architecture", "general.name", "tokenizer.chat_template")


@dataclass(frozen=True)
class ServableModel:
    name: str  # what it is served as (/v1/models, /api/tags, every answer)
    path: Path
    aliases: frozenset[str]  # every name a request may use, `name` included
    default: bool  # the configured target: served when a request names no model
    family_built: bool  # its draft pool is built (data/families/<stem>/family.json)


@dataclass(frozen=True)
class _Header:
    general_name: str | None
    metadata: dict[str, str]


class ModelCatalog:
    def __init__(self, settings: Settings):
        self._settings = settings
        self._headers: dict[tuple[Path, int, int], _Header] = {}
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
        """The configured target first, then every other model in the models dir by name."""
        default = self.default_path
        rows = [self._model(self.default_name, default, True)]
        taken = {rows[0].name}
        for path in sorted(models_dir().glob("*.gguf")):
            if path.resolve() == default.resolve() or not self._is_model(path):
                continue
            name = ollama_name(path)
            if name is None or name in taken:
                name = as_model_id(path.stem) or path.stem
            if name in taken:
                continue
            taken.add(name)
            rows.append(self._model(name, path, False))
        return rows

    def find(self, name: str | None) -> ServableModel | None:
        """The model a request names (None or "": the default); None if none answers to it."""
        models = self.models()
        if not name:
            return models[0]
        exact = next((m for m in models if m.name == name), None)
        if exact is not None:
            return exact
        # The default's aliases win a clash: the file as configured keeps meaning the target.
        return next((m for m in models if name in m.aliases), None) or (
            models[0] if name in (self._settings.target, default_file(self._settings)) else None
        )

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


def default_file(settings: Settings) -> str:
    return Path(settings.target).name
