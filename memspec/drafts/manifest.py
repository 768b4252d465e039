"""Draft manifests (drafts/*.toml): what each draft is, where its file comes from, how to build it.

A bad manifest fails with the file and field named. Ids are plain names, never paths, and a
manifest's file must stay inside the models directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from memspec.compat import tomllib
from memspec.config import env_manifest_dir
from memspec.errors import UnknownDraft

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _default_manifest_dir() -> Path:
    """$MEMSPEC_MANIFEST_DIR, else drafts/ of a source checkout, else /etc/memspec/drafts."""
    env = env_manifest_dir()
    if env is not None:
        return env
    checkout = Path(__file__).resolve().parent.parent.parent / "drafts"
    return checkout if checkout.is_dir() else Path("/etc/memspec/drafts")


DEFAULT_MANIFEST_DIR = _default_manifest_dir()


class ManifestError(ValueError):
    pass


def check_id(draft_id: str) -> str:
    if not ID_PATTERN.match(draft_id) or ".." in draft_id:
        raise UnknownDraft(
            f"invalid draft id {draft_id!r}: use letters, digits, '.', '_', '-'", param="draft"
        )
    return draft_id


def check_file_name(name: str) -> str:
    """A model file named in a manifest: a plain file name inside the models directory."""
    if not name or Path(name).name != name or name in {".", ".."}:
        raise ValueError(f"file must be a plain file name inside the models directory: {name!r}")
    return name


class BuildRecipe(BaseModel, extra="forbid"):
    recipe: Literal["quantize", "layers", "datastore", "distill", "head"]
    source: str  # file name in the models directory (the testbed GGUF or another built file)
    ftype: str = "F32"  # llama.cpp file type: F32, F16, Q8_0, Q4_0, Q4_1, Q2_K, ...
    keep_layers: list[int] | None = None  # recipes "layers", "distill": blocks to keep
    # recipe "datastore": the source GGUF (the target) answers seed prompts greedily; its
    # outputs plus package text (stdlib source, pydoc) are tokenized and indexed.
    domains: list[str] | None = None  # seed domains (drafts/seeds/prompts.jsonl); None: all
    seeds_per_domain: int | None = None  # None: every seed prompt of those domains
    gen_tokens: int = 96  # new tokens per seed prompt
    package_chars: int = 0  # characters of stdlib source + pydoc text to add
    max_tokens: int | None = None  # cap on the datastore's tokens
    seed: int = 0  # which seed prompts / files are chosen (and, for "distill", the batches)
    # recipes "distill", "head": where the target runs to answer the seed prompts and label the
    # corpus. "llama_cpp": the serving runtime, its exact F32 greedy answers. "torch": the same
    # GGUF through transformers, answers in bfloat16 and labels (features, logits) in float32,
    # several times faster on a CPU with bfloat16 units (docs/drafts.md, "Heads").
    teacher: Literal["llama_cpp", "torch"] = "llama_cpp"
    # recipe "distill" (memspec.recipes.distill): the same corpus, a student trained with torch
    # for `steps` batches of `batch_size` sequences of at most `seq_len` tokens; `ftype` is the
    # quantization of the exported GGUF.
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-4
    ckpt_every: int = 20  # steps between checkpoints (an interrupted build resumes there)
    eval_seqs: int = 64  # held-out sequences for the agreement report
    # recipe "head" (memspec.recipes.head_build): the same corpus (gen_tokens 0: the seed
    # prompts alone, teacher-forced), the target's features at every position; a head with a
    # gated MLP of `hidden` units drafting over the `subvocab` most frequent target tokens,
    # trained `steps` batches of `batch_size` positions.
    subvocab: int = 4096
    hidden: int = 1024
    # On-demand recipes are built only when named (`--only ID`): the full-size datastores
    # take tens of minutes of target decoding, more than a default build should.
    on_demand: bool = False

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return check_file_name(v)


class DraftManifest(BaseModel, extra="forbid"):
    id: str
    kind: Literal["model", "prompt_lookup", "datastore", "head"]
    description: str = ""
    file: str | None = None  # model: a GGUF; datastore: .npz; head: .safetensors (models dir)
    tags: list[str] = Field(default_factory=list)
    params: dict[str, int | float | str] = Field(default_factory=dict)
    build: BuildRecipe | None = None
    source_path: Path | None = Field(default=None, exclude=True)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not ID_PATTERN.match(v) or ".." in v:
            raise ValueError("id must be a plain name (letters, digits, '.', '_', '-')")
        return v

    @field_validator("file")
    @classmethod
    def _file(cls, v: str | None) -> str | None:
        return None if v is None else check_file_name(v)

    def is_built(self, models_dir: Path) -> bool:
        """Whether the file it names is there (weightless kinds: always)."""
        return self.file is None or (models_dir / self.file).is_file()

    def model_path(self, models_dir: Path) -> Path:
        if self.file is None:
            raise ManifestError(f"draft {self.id} has no model file")
        return models_dir / self.file


MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few lines; a huge file is not read at all


def load_manifest(path: Path) -> DraftManifest:
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path}: {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ManifestError(f"{path}: {e}") from e
    try:
        m = DraftManifest.model_validate(data)
    except ValidationError as e:
        errs = "; ".join(f"field '{'.'.join(map(str, x['loc']))}': {x['msg']}" for x in e.errors())
        raise ManifestError(f"{path}: {errs}") from e
    from memspec.drafts.registry import draft_kind  # the registry builds on manifests

    if draft_kind(m.kind).has_file and not m.file:
        raise ManifestError(f"{path}: field 'file': required for kind '{m.kind}'")
    m.source_path = path
    return m


def load_manifests(
    directory: Path = DEFAULT_MANIFEST_DIR, errors: dict[str, str] | None = None
) -> dict[str, DraftManifest]:
    """Every manifest in `directory`. A bad one raises ManifestError, or, given `errors` (the
    daemon), is left out with its reason there (keyed by file stem): one broken file must not
    keep the daemon from serving the other drafts."""
    manifests: dict[str, DraftManifest] = {}
    for path in sorted(directory.glob("*.toml")):
        try:
            m = load_manifest(path)
            if m.id in manifests:
                raise ManifestError(f"{path}: field 'id': duplicate id {m.id!r}")
        except ManifestError as e:
            if errors is None:
                raise
            errors[path.stem] = str(getattr(e, "message", e))
            continue
        manifests[m.id] = m
    return manifests
