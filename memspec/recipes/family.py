"""Building a target's draft family (`memspec drafts build --target FILE`): its manifests
written, then built recipe by recipe (memspec.recipes.build). Which recipes a family has and
where they live is the runtime's side, memspec.drafts.family."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from memspec.drafts.family import (
    Planned,
    Sibling,
    family_dir,
    find_siblings,
    manifest_toml,
    named_sibling,
    plan_family,
    slug,
)
from memspec.paths import models_dir
from memspec.recipes.build import build_one


def link_target(target: Path) -> None:
    """Recipes name their source inside the models directory: link a target kept elsewhere."""
    inside = models_dir() / target.name
    if inside.resolve() == target.resolve():
        return
    if inside.exists() or inside.is_symlink():
        raise FileExistsError(
            f"{inside} exists and is not {target}: rename one of them, or copy the target into "
            f"{models_dir()}"
        )
    inside.symlink_to(target.resolve())


def build_family(
    target: Path, only: list[str] | None = None, force: bool = False, sibling: Path | None = None
) -> tuple[list[tuple[str, Path, bool]], list[Planned], list[Sibling]]:
    """Write the family's manifests and build what they name (resumable: each recipe is cached
    by build_one; a datastore's target answers are cached as they come). `sibling` names the
    sibling draft (DraftIncompatible if it speaks another tokenizer); without it, siblings are
    found in the models directory. Returns the built (id, path, whether anything was done),
    the skipped recipes and the siblings."""
    if not target.is_file():
        raise FileNotFoundError(f"target {target} not found")
    models_dir().mkdir(parents=True, exist_ok=True)
    link_target(target)
    siblings = [named_sibling(target, sibling)] if sibling else find_siblings(target)
    for s in siblings:
        link_target(s.path)
    plan = plan_family(target, siblings)
    directory = family_dir(target)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.toml"):  # a recipe skipped now must not linger
        old.unlink()
    for p in plan:
        if p.manifest is not None:
            (directory / f"{p.id}.toml").write_text(manifest_toml(p.manifest))
    todo = [
        p.manifest
        for p in plan
        if p.manifest is not None
        and p.manifest.build is not None
        and (p.id in only if only else not p.manifest.build.on_demand)
    ]
    done = []
    for m in tqdm(todo, desc=f"drafts build ({slug(target)})", unit="draft"):
        path, built = build_one(m, models_dir(), force=force)
        done.append((m.id, path, built))
    skipped = [p for p in plan if p.manifest is None]
    report = {
        "target": str(target),
        "siblings": [
            {"id": s.id, "file": str(s.path), "bytes": s.bytes, "how": s.how} for s in siblings
        ],
        "built": [{"id": i, "file": str(path), "rebuilt": b} for i, path, b in done],
        "skipped": [{"id": p.id, "reason": p.reason} for p in skipped],
    }
    (directory / "family.json").write_text(json.dumps(report, indent=2) + "\n")
    return done, skipped, siblings
