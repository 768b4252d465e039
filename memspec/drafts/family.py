"""Draft families: the pool of drafts derived for one target, stored per target.

The testbed target (a file some manifest under drafts/targets/ builds) uses the checked-in
pool, drafts/*.toml. Any other target gets a family of its own, derived from that same pool by
`memspec drafts build --target FILE` (memspec.recipes.family builds it): every testbed
manifest is re-aimed at the target (its `build.source`), its file renamed `<slug>-<file>` in
the models directory, and its manifest written to `<data>/families/<slug>/`, so two targets'
drafts never clash. Recipes that cannot
pay for this target are skipped with the reason (a self-draft no smaller than the target or
than a sibling, a distilled student of another architecture). A *sibling* (a smaller GGUF of
the same tokenizer in the models directory, or one named with `--sibling`: Qwen2.5-Coder 0.5B
beside its 1.5B) joins the family as a model draft of its own. `pool_dir` is the one place
that says which manifests a runtime, `drafts list` or `plan` read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from memspec.config import Settings
from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, DraftManifest, load_manifests
from memspec.errors import UnknownDraft
from memspec.paths import data_dir, models_dir, resolve_model_path

# Nominal bits per weight of llama.cpp file types (general.file_type), for the self-draft rule.
FTYPE_BITS = {
    0: 32.0,  # F32
    1: 16.0,  # F16
    32: 16.0,  # BF16
    7: 8.5,  # Q8_0
    2: 4.5,  # Q4_0
    3: 5.0,  # Q4_1
    8: 5.5,  # Q5_0
    9: 6.0,  # Q5_1
    10: 2.6,  # Q2_K
    11: 3.4,  # Q3_K_S
    12: 3.9,  # Q3_K_M
    13: 4.3,  # Q3_K_L
    14: 4.6,  # Q4_K_S
    15: 4.8,  # Q4_K_M
    16: 5.5,  # Q5_K_S
    17: 5.7,  # Q5_K_M
    18: 6.6,  # Q6_K
}
# llama.cpp's file types (enum llama_ftype) by value: what Ollama reports as a model's
# quantization_level (the file's type, Q4_K_M, not its dominant tensor type, Q4_K).
FTYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}  # fmt: skip
FTYPE_BY_NAME = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q2_K": 10, "Q4_K_M": 15}
# A self-draft pays only if reading its weights is clearly cheaper than the target's: at most
# this share of the target's bits per weight.
SELF_DRAFT_MAX_BITS_SHARE = 0.7


def slug(target: Path) -> str:
    """A file-name-safe name for a target: its file stem, lowercased."""
    return re.sub(r"[^a-z0-9._-]+", "-", target.stem.lower()).strip("-.") or "target"


def family_dir(target: Path) -> Path:
    return data_dir() / "families" / slug(target)


def is_testbed_target(target: Path) -> bool:
    """Whether a checked-in target manifest builds this file (its pool is drafts/*.toml)."""
    targets = DEFAULT_MANIFEST_DIR / "targets"
    if not targets.is_dir():
        return False
    return any(m.file == target.name for m in load_manifests(targets).values())


def pool_dir(target: Path, configured: Path | None = None) -> Path:
    """The manifests of a target's draft pool: the configured dir, else the testbed's for the
    testbed target, else the target's family once built, else the testbed's (whose drafts the
    runtime then checks against the target's tokenizer, leaving out what does not fit)."""
    if configured is not None:
        return configured
    if is_testbed_target(target):
        return DEFAULT_MANIFEST_DIR
    family = family_dir(target)
    return family if any(family.glob("*.toml")) else DEFAULT_MANIFEST_DIR


def settings_pool_dir(settings: Settings) -> Path:
    """pool_dir for the configured target and manifest_dir."""
    return pool_dir(resolve_model_path(settings.target), settings.manifest_dir)


def skipped_recipes(directory: Path) -> dict[str, str]:
    """The recipes a family left out, with the reason (empty for the testbed pool)."""
    report = directory / "family.json"
    if not report.is_file():
        return {}
    return {s["id"]: s["reason"] for s in json.loads(report.read_text()).get("skipped", [])}


def skipped_error(draft_id: str, reason: str) -> UnknownDraft:
    """What naming a draft the target's family skipped gets: the reason, not "unknown"."""
    return UnknownDraft(
        f"draft {draft_id!r} was not built for this target: {reason}", param="draft"
    )


@dataclass(frozen=True)
class Planned:
    id: str
    manifest: DraftManifest | None  # None: skipped
    reason: str  # why it is skipped ("" when planned)


def _header(target: Path) -> tuple[str, int, int | None]:
    """(architecture, block count, general.file_type) from the GGUF header."""
    from memspec.drafts.gguf_header import open_header, scalar

    reader = open_header(target)
    arch = scalar(reader, "general.architecture") or "llama"
    ftype = scalar(reader, "general.file_type")
    return (
        arch,
        int(scalar(reader, f"{arch}.block_count") or 0),
        None if ftype is None else int(ftype),
    )


def _skip_reason(m: DraftManifest, target: Path, siblings: list[Sibling]) -> str:
    """Why this testbed recipe cannot pay for `target` ("" when it can)."""
    if m.build is None:
        return ""
    arch, n_layers, src_type = _header(target)
    if m.build.recipe == "quantize":
        src_bits = FTYPE_BITS.get(src_type, 16.0) if src_type is not None else 16.0
        draft_type = FTYPE_BY_NAME.get(m.build.ftype)
        draft_bits = FTYPE_BITS.get(draft_type, 16.0) if draft_type is not None else 16.0
        if draft_bits > SELF_DRAFT_MAX_BITS_SHARE * src_bits:
            return (
                f"the target is already {src_bits:.1f} bits/weight; a {m.build.ftype} "
                f"self-draft ({draft_bits:.1f}) would cost about what the target costs"
            )
        # A draft's step reads its weights: a self-draft bigger than a sibling costs more per
        # token, and a model trained at that size agrees with the target better than a copy
        # quantized to ~2-3 bits (SmolLM2's Q2_K self-draft: alpha ~0.55, DESIGN.md).
        est = int(target.stat().st_size * draft_bits / src_bits)
        smaller = [s for s in siblings if s.bytes <= est]
        if smaller:
            return (
                f"a {m.build.ftype} self-draft would be about {est / 1e6:.0f} MB, no smaller "
                f"than the sibling {smaller[0].path.name} ({smaller[0].bytes / 1e6:.0f} MB), "
                "which is a model of its own at that size"
            )
        return ""
    if m.build.recipe in ("distill", "layers"):
        if arch != "llama":
            return (
                f"recipe {m.build.recipe} builds llama-architecture students; the target is {arch}"
            )
        if any(i >= n_layers for i in m.build.keep_layers or []):
            return f"keeps blocks {m.build.keep_layers}; the target has {n_layers}"
    return ""


# The target size the CI-sized recipes were sized for (answering their seed prompts takes a few
# minutes on 2 cores); a bigger target answers fewer of them, so the recipe keeps its minutes.
CI_RECIPE_TARGET_BYTES = 600e6


def ci_seeds(seeds_per_domain: int, target: Path) -> int:
    """Seed prompts per domain of a CI-sized recipe for `target` (Qwen2.5-Coder-1.5B: 2 of 4)."""
    scale = CI_RECIPE_TARGET_BYTES / max(target.stat().st_size, 1)
    return max(1, min(seeds_per_domain, int(seeds_per_domain * scale)))


def plan_family(target: Path, siblings: list[Sibling] | None = None) -> list[Planned]:
    """The testbed pool re-aimed at `target`, one entry per manifest, planned or skipped,
    then one model draft per sibling. Files are `<slug>-<id of the recipe that builds it>
    <suffix>`; a sibling keeps its own file."""
    siblings = siblings or []
    name, prefix = target.name, slug(target)
    testbed = load_manifests(DEFAULT_MANIFEST_DIR)
    # Files are named after the recipe that builds them (datastore-live reads datastore's).
    builder = {m.file: m.id for m in testbed.values() if m.file and m.build}
    out = []
    for m in testbed.values():
        reason = _skip_reason(m, target, siblings)
        if reason:
            out.append(Planned(m.id, None, reason))
            continue
        data = m.model_dump(exclude={"source_path"})
        if m.build is not None and "ci" in m.tags and m.build.seeds_per_domain:
            data["build"]["seeds_per_domain"] = ci_seeds(m.build.seeds_per_domain, target)
        if m.file:
            data["file"] = f"{prefix}-{builder.get(m.file, m.id)}{Path(m.file).suffix}"
        if m.build is not None:
            data["build"]["source"] = name
        data["description"] = f"derived for {name} from drafts/{m.id}.toml: {m.description}"
        out.append(Planned(m.id, DraftManifest.model_validate(data), ""))
    # A file another recipe builds (e.g. datastore-live reads datastore's) is usable only if
    # that recipe is planned too.
    built_files = {p.manifest.file for p in out if p.manifest and p.manifest.build}
    return [Planned(s.id, sibling_manifest(s, target), "") for s in siblings] + [
        Planned(p.id, None, f"needs {p.manifest.file}, which no planned recipe builds")
        if p.manifest
        and p.manifest.file
        and not p.manifest.build
        and p.manifest.file not in built_files
        else p
        for p in out
    ]


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def manifest_toml(m: DraftManifest) -> str:
    """A manifest as TOML that load_manifest reads back to the same model."""
    data = m.model_dump(exclude={"source_path"}, exclude_none=True)
    tables = {k: data.pop(k) for k in ("params", "build") if k in data}
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items()]
    for table, values in tables.items():
        if values:
            lines += ["", f"[{table}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


# --- siblings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sibling:
    """A smaller model of the target's tokenizer: a draft nobody has to build."""

    id: str
    path: Path
    bytes: int
    how: str  # "found" (same tokenizer, in the models directory) or "named" (--sibling)


def _sibling_id(path: Path) -> str:
    """`sibling-<size label>` (Qwen2.5-Coder 0.5B: sibling-0.5b), else `sibling-<file stem>`."""
    from memspec.drafts.gguf_header import open_header, scalar

    label = scalar(open_header(path), "general.size_label")
    base = str(label) if label else path.stem
    return ("sibling-" + re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-."))[:64]


def named_sibling(target: Path, path: Path) -> Sibling:
    """The sibling `--sibling` names: DraftIncompatible (with llama.cpp's reason) if it speaks
    another tokenizer than the target, ValueError if it is the target or no smaller."""
    from memspec.drafts.compat import fingerprint_of, incompatibility, incompatible_error

    if not path.is_file():
        raise FileNotFoundError(f"sibling {path} not found")
    if path.resolve() == target.resolve():
        raise ValueError(f"sibling {path.name} is the target itself")
    size, target_size = path.stat().st_size, target.stat().st_size
    if size >= target_size:
        raise ValueError(
            f"sibling {path.name} ({size / 1e6:.0f} MB) is no smaller than the target "
            f"({target_size / 1e6:.0f} MB): as a draft it would cost more than it saves"
        )
    t, d = fingerprint_of(target), fingerprint_of(path)
    reason = "it carries no tokenizer" if t is None or d is None else incompatibility(t, d)
    if reason:
        raise incompatible_error(_sibling_id(path), reason)
    return Sibling(_sibling_id(path), path, size, "named")


# A sibling pays as a draft only if its step costs clearly less than the target's: at most this
# share of the target's weights (decode_params). Qwen2.5-Coder 0.5B beside its 1.5B is 0.32 and
# Llama 3.2 1B beside its 3B 0.385 (both pairs that speculate well); by file bytes they would
# be 0.44 and 0.41, since the small ones keep more of themselves in a wide embedding.
SIBLING_MAX_SHARE = 0.4


def decode_params(path: Path) -> int:
    """The weights a decoding step multiplies by, in parameters (as a model card counts them,
    whatever the quantization): every tensor but the token embedding, which a step only looks
    one row up in, unless it is tied (no output.weight), when it is the output layer too."""
    from memspec.drafts.gguf_header import open_header

    tensors = open_header(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_elements) for t in tensors if tied or t.name != "token_embd.weight")


def catalog_paths(settings: Settings | None = None) -> list[Path]:
    """The files of the models the catalog serves, read from where memspec.catalog reads them
    (which builds on this module): the loose GGUFs of the models dir that are no built draft,
    and the GGUF blob of every model of memspec's own store and of the adopted Ollama store
    (`settings`' ollama_models; default: this process's environment), refused ones left out."""
    from memspec.errors import MemSpecError
    from memspec.ollama_store import adopted_store, own_store
    from memspec.store_model import read_store_model

    paths = [
        p
        for p in sorted(models_dir().glob("*.gguf"))
        if not p.with_name(p.name + ".build.json").is_file()
        or (family_dir(p) / "family.json").is_file()
    ]
    for store in (own_store(), adopted_store(settings or Settings())):
        if store is None:
            continue
        try:
            names = store.names()
        except (MemSpecError, OSError):
            continue
        for name in names:
            try:
                entry = read_store_model(store, name)
            except (MemSpecError, OSError, ValueError):
                continue
            if not isinstance(entry, str) and entry.refused is None:
                paths.append(entry.model_path)
    return paths


def find_siblings(target: Path, candidates: Iterable[Path] | None = None) -> list[Sibling]:
    """The models of the catalog (`candidates`, default catalog_paths(): loose GGUFs and store
    models alike) that speak the target's tokenizer and carry at most SIBLING_MAX_SHARE of its
    weights (and fewer bytes), the largest first: found by scanning headers, never by a family
    table. Neither the target (a hard link of it included) nor a file derived from it
    (`<slug>-*`) is one."""
    from memspec.drafts.compat import fingerprint_of, incompatibility
    from memspec.errors import ModelLoadError

    want = fingerprint_of(target)
    if want is None:
        return []
    target_size, own = target.stat().st_size, slug(target) + "-"
    limit = decode_params(target) * SIBLING_MAX_SHARE
    found, seen = [], set()
    for path in candidates if candidates is not None else catalog_paths():
        try:
            st = path.stat()
            inode = (st.st_dev, st.st_ino)
            if inode in seen or path.samefile(target) or path.name.lower().startswith(own):
                continue
            seen.add(inode)
            if st.st_size >= target_size or decode_params(path) > limit:
                continue
            fp = fingerprint_of(path)
        except (ModelLoadError, OSError, ValueError):
            continue  # unreadable here: not a sibling (a load would say why)
        if fp is not None and incompatibility(want, fp) is None:
            found.append(Sibling(_sibling_id(path), path, st.st_size, "found"))
    found.sort(key=lambda s: -s.bytes)
    ids = [s.id for s in found]  # two files with one size label: fall back to file stems
    return [
        s if ids.count(s.id) == 1 else replace(s, id=f"sibling-{slug(s.path)}"[:64]) for s in found
    ]


def sibling_manifest(s: Sibling, target: Path) -> DraftManifest:
    """A sibling as a model draft of the target's family (its file, as found, is the draft)."""
    return DraftManifest.model_validate(
        {
            "id": s.id,
            "kind": "model",
            "file": s.path.name,
            "description": f"sibling of {target.name}: {s.path.name}, a smaller model of the "
            f"same tokenizer ({s.how})",
            "tags": ["sibling"],
        }
    )
