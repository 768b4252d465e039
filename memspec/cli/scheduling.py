"""Draft selection and residency: `traces collect`, `predictor train|show`, `simulate`,
`sim calibrate` (`bench policies` is in memspec.cli.bench)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memspec.cli.flags import load_settings, model_flags, workload_flags


def cmd_traces_collect(args: argparse.Namespace) -> int:
    from memspec.drafts.family import settings_pool_dir
    from memspec.runtime import Runtime
    from memspec.sim.traces import built_pool, collect
    from memspec.sim.workload import requests_for
    from memspec.testbed import select_questions

    settings = load_settings(args)
    if args.drafts is None:  # the whole pool, as far as it is built
        settings = settings.model_copy(update={"drafts": built_pool(settings_pool_dir(settings))})
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


def cmd_predictor_train(args: argparse.Namespace) -> int:
    from memspec.predictor.artifacts import trained_path
    from memspec.sim.traces import load_trace
    from memspec.sim.train_predictor import TrainConfig, train_from_traces

    traces = [Path(t) for t in args.traces]
    collected_on = {Path(load_trace(t).header["settings"]["target"]).name for t in traces}
    target = Path(args.target).name if args.target else None
    if len(collected_on) > 1 or (target is not None and collected_on != {target}):
        print(
            f"memspec: error: the traces were collected on {', '.join(sorted(collected_on))}"
            + (f", not on {target}" if target else "; train one predictor per target"),
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else trained_path(Path(target or collected_on.pop()))
    out.parent.mkdir(parents=True, exist_ok=True)
    config = TrainConfig(epochs=args.epochs, l2=args.l2, holdout=args.holdout, seed=args.seed)
    report = train_from_traces(traces, out, config)
    print(json.dumps(report, indent=2))
    return 0


def cmd_predictor_show(args: argparse.Namespace) -> int:
    from memspec.predictor.model import load_predictor

    pred = load_predictor(Path(args.path))
    print(json.dumps(pred.describe(), indent=2))
    return 0


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
    from memspec.drafts.family import settings_pool_dir
    from memspec.sim.profile import calibrate_this_machine
    from memspec.sim.traces import built_pool

    settings = load_settings(args)
    if args.drafts is None:
        settings = settings.model_copy(update={"drafts": built_pool(settings_pool_dir(settings))})
    path = calibrate_this_machine(settings, Path(args.out) if args.out else None, args.load_reps)
    print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("traces", help="per-round traces of every draft on a workload")
    tsub = p.add_subparsers(dest="action", required=True)
    c = tsub.add_parser("collect", help="run plain decoding and every draft; write JSONL")
    model_flags(c)
    c.add_argument("--out", required=True, help="trace file (JSONL)")
    workload_flags(c, per_category=2, offset=0)
    c.add_argument("--max-tokens", type=int, default=96)
    c.add_argument("--k", type=int, default=4, help="k of the measured fixed-draft runs")
    c.add_argument("--load-reps", type=int, default=3, help="real loads timed per draft")
    c.add_argument("--no-runs", action="store_true", help="skip the measured per-draft runs")
    c.set_defaults(func=cmd_traces_collect)

    p = sub.add_parser("predictor", help="the acceptance predictor: train from traces, show")
    psub = p.add_subparsers(dest="action", required=True)
    t = psub.add_parser("train", help="fit the predictor on traces; write a JSON artifact")
    t.add_argument("--traces", nargs="+", required=True, help="trace files (JSONL)")
    t.add_argument(
        "--target",
        help="the target the traces were collected on (checked); its predictor is what the "
        "daemon then loads for it",
    )
    t.add_argument(
        "--out",
        help="artifact (default: <data>/predictors/<target>.json, which the daemon loads for "
        "that target before the shipped ones)",
    )
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
