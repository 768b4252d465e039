"""Subcommands for draft selection and residency: traces, predictor, simulate, bench policies.

Registered into `memspec` by memspec.cli (kept apart so the shared CLI module stays small).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _settings(args: argparse.Namespace, **extra):
    from memspec.cli import _settings as base

    s = base(args)
    for k, v in extra.items():
        setattr(s, k, v)
    return s


def _workload_flags(p: argparse.ArgumentParser, per_category: int, offset: int) -> None:
    p.add_argument("--per-category", type=int, default=per_category, help="questions per category")
    p.add_argument("--offset", type=int, default=offset, help="skip this many per category")
    p.add_argument("--categories", nargs="*", help="only these MT-Bench categories")
    p.add_argument("--turns", type=int, choices=[1, 2], default=2, help="turns per question")


# --- traces -------------------------------------------------------------------------------


def cmd_traces_collect(args: argparse.Namespace) -> int:
    from memspec.runtime import Runtime
    from memspec.sim.traces import built_pool, collect
    from memspec.sim.workload import requests_for
    from memspec.testbed import select_questions

    settings = _settings(args)
    if args.drafts is None:  # the whole pool, as far as it is built
        settings.drafts = built_pool(settings.manifest_dir)
    questions = select_questions(args.per_category, args.offset, args.categories)
    requests = requests_for(questions, args.turns)
    rt = Runtime(settings)
    try:
        trace = collect(
            rt,
            requests,
            Path(args.out),
            max_tokens=args.max_tokens,
            k_run=args.k,
            load_reps=args.load_reps,
            with_runs=not args.no_runs,
        )
    finally:
        rt.close()
    same = all(r.identical for q in trace.requests for r in q.runs.values())
    print(
        f"{len(trace.requests)} requests, drafts {', '.join(trace.draft_ids)}; "
        f"every run identical to plain decoding: {same} -> {args.out}"
    )
    return 0 if same else 1


# --- predictor ----------------------------------------------------------------------------


def cmd_predictor_train(args: argparse.Namespace) -> int:
    from memspec.predictor.train import TrainConfig, train_from_traces

    config = TrainConfig(epochs=args.epochs, l2=args.l2, holdout=args.holdout, seed=args.seed)
    report = train_from_traces([Path(t) for t in args.traces], Path(args.out), config)
    print(json.dumps(report, indent=2))
    return 0


def cmd_predictor_show(args: argparse.Namespace) -> int:
    from memspec.predictor.model import load_predictor

    pred = load_predictor(Path(args.path))
    print(json.dumps(pred.describe(), indent=2))
    return 0


# --- simulator ----------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from memspec.sim.profile import profile_for
    from memspec.sim.simulator import simulate_policy
    from memspec.sim.traces import load_trace

    trace = load_trace(args.trace)
    profile = profile_for(args.profile, trace)
    result = simulate_policy(
        trace,
        profile,
        args.policy,
        budget=args.budget,
        requests=args.requests,
        predictor=args.predictor,
        seed=args.seed,
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_sim_calibrate(args: argparse.Namespace) -> int:
    from memspec.sim.profile import calibrate_this_machine
    from memspec.sim.traces import built_pool

    settings = _settings(args)
    if args.drafts is None:
        settings.drafts = built_pool(settings.manifest_dir)
    path = calibrate_this_machine(settings, Path(args.out) if args.out else None, args.load_reps)
    print(path)
    return 0


# --- bench --------------------------------------------------------------------------------


def cmd_bench_policies(args: argparse.Namespace) -> int:
    from memspec.bench.policies import BenchConfig, run_policy_bench

    config = BenchConfig(
        mode=args.mode,
        budget=args.budget,
        quick=args.quick,
        trace=args.trace,
        profile=args.profile,
        per_category=args.per_category,
        offset=args.offset,
        categories=args.categories,
        turns=args.turns,
        max_tokens=args.max_tokens,
        sim_requests=args.requests,
        policies=args.policies,
        predictor=args.predictor,
        curve=not args.no_curve,
        extra={"drafts_given": args.drafts is not None},
    )
    report = run_policy_bench(_settings(args), config, Path(args.out), args.plot)
    return 0 if report.get("all_identical", True) else 1


def register(sub: argparse._SubParsersAction, model_flags) -> None:
    """Add `traces`, `predictor`, `simulate`, `sim` and `bench policies` to the CLI."""
    p = sub.add_parser("traces", help="per-round traces of every draft on a workload")
    tsub = p.add_subparsers(dest="action", required=True)
    c = tsub.add_parser("collect", help="run plain decoding and every draft; write JSONL")
    model_flags(c)
    c.add_argument("--out", required=True, help="trace file (JSONL)")
    _workload_flags(c, per_category=2, offset=0)
    c.add_argument("--max-tokens", type=int, default=96)
    c.add_argument("--k", type=int, default=4, help="k of the measured fixed-draft runs")
    c.add_argument("--load-reps", type=int, default=3, help="real loads timed per draft")
    c.add_argument("--no-runs", action="store_true", help="skip the measured per-draft runs")
    c.set_defaults(func=cmd_traces_collect)

    p = sub.add_parser("predictor", help="the acceptance predictor: train from traces, show")
    psub = p.add_subparsers(dest="action", required=True)
    t = psub.add_parser("train", help="fit the predictor on traces; write a JSON artifact")
    t.add_argument("--traces", nargs="+", required=True, help="trace files (JSONL)")
    t.add_argument("--out", required=True, help="artifact, e.g. predictors/NAME.json")
    t.add_argument("--epochs", type=int, default=400)
    t.add_argument("--l2", type=float, default=1e-2)
    t.add_argument("--holdout", type=float, default=0.25, help="share of questions held out")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_predictor_train)
    s = psub.add_parser("show", help="describe an artifact")
    s.add_argument("path")
    s.set_defaults(func=cmd_predictor_show)

    p = sub.add_parser("simulate", help="replay a trace under a device profile and a policy")
    p.add_argument(
        "--profile", required=True, help="profile name, TOML file, or 'trace' (its own costs)"
    )
    p.add_argument("--trace", required=True)
    p.add_argument("--policy", required=True, help="none, fixed:<id>, ucb, exp3, memspec, oracle")
    p.add_argument("--budget", required=True, help="bytes, e.g. 900MB or 4.5GiB")
    p.add_argument("--requests", type=int, help="requests to replay (cycles the trace)")
    p.add_argument("--predictor", help="predictor artifact (default: the daemon's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("sim", help="simulator device profiles")
    ssub = p.add_subparsers(dest="action", required=True)
    c = ssub.add_parser("calibrate", help="measure this machine; write the this-machine profile")
    model_flags(c)
    c.add_argument("--out", help="profile TOML (default memspec/sim/profiles/this-machine.toml)")
    c.add_argument("--load-reps", type=int, default=5)
    c.set_defaults(func=cmd_sim_calibrate)


def register_bench(bsub: argparse._SubParsersAction, model_flags) -> None:
    b = bsub.add_parser("policies", help="none/fixed/ucb/exp3/memspec/oracle on a mixed workload")
    model_flags(b)
    b.add_argument("--mode", choices=["live", "sim"], required=True)
    b.add_argument("--budget", required=True, help="bytes (target + KV + drafts), or 'auto'")
    b.add_argument("--out", required=True, help="JSON output")
    b.add_argument("--plot", help="PNG: policies, and tokens/s vs budget (SpecMemo curve)")
    b.add_argument("--quick", action="store_true", help="small workload (tests/CI)")
    b.add_argument("--trace", help="trace covering the workload (live: collected if missing)")
    b.add_argument("--profile", default="this-machine", help="sim: device profile")
    _workload_flags(b, per_category=2, offset=5)
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--requests", type=int, default=2000, help="sim: requests replayed")
    b.add_argument("--policies", nargs="*", help="subset of policies")
    b.add_argument("--predictor", help="predictor artifact (default: the daemon's)")
    b.add_argument("--no-curve", action="store_true", help="skip the budget sweep")
    b.set_defaults(func=cmd_bench_policies)


if __name__ == "__main__":  # pragma: no cover
    from memspec.cli import main

    sys.exit(main())
