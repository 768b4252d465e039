"""`memspec bench kernels`: the price of bit-exactness, per target and kernel configuration.

For each target, each configuration runs in a process of its own (ggml reads
GGML_CPU_TILED_MM once per process) and measures, on one prompt of real text:
- prompt processing (tokens/s over a 256-token prompt, one pass);
- plain decoding (tokens/s, one token per pass, argmax read in place);
- the verify curve (ms per pass of n rows after a rollback, as verification runs them);
- whether every pass size gives the logits of single steps bit for bit (and the largest gap).

Configurations: the target's weights as stored with neither multi-row kernel (`plain`),
repacked under the row rule with ggml's tiled K-quant matmul off (`repack+rule`, wave 3's
default) and on (`repack+tiled+rule`, the daemon's default), and without the rule (`repack`,
`repack+tiled`: what a server that does not promise bit-exactness runs; the second is
llama-server's kernels). Ratios are to `plain` from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# name: (GGML_CPU_TILED_MM, weight_repack, row rule)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "plain": ("0", False, True),
    "repack+rule": ("0", True, True),
    "repack+tiled+rule": ("1", True, True),
    "repack": ("0", True, False),
    "repack+tiled": ("1", True, False),
}
PASS_ROWS = (1, 2, 3, 4, 5, 8, 9)
REPEATS = 3  # timed passes per verify size (the least is kept: noise only adds)


def measure(
    target: Path, repack: bool, rule: bool, n_threads: int | None, prompt_n: int, decode_n: int
) -> dict[str, Any]:
    """One configuration, in this process (GGML_CPU_TILED_MM is already set)."""
    import numpy as np

    from memspec.backends.base import BackendOptions, load_backend
    from memspec_lab.bench.workloads import load_workload

    options = BackendOptions(
        n_ctx=1024, n_threads=n_threads, weight_repack=repack, batch_invariant=rule
    )
    be = load_backend(target, options)
    try:
        text = "\n\n".join(p.text for p in load_workload("heldout", 10, None))
        toks = be.tokenize(text)[: prompt_n + max(decode_n, max(PASS_ROWS) * REPEATS)]
        prompt, rest = toks[:prompt_n], toks[prompt_n:]
        be.eval(prompt[:8], all_logits=False)  # warm-up: first-touch pages, thread pool
        be.reset()
        t = time.perf_counter()
        be.eval(prompt, all_logits=False)
        prompt_s = time.perf_counter() - t
        singles, t = [], time.perf_counter()
        for tok in rest:
            singles.append(be.eval([tok], copy=False)[0].copy())
        decode_s = time.perf_counter() - t
        single = np.stack(singles)
        verify: dict[str, Any] = {}
        for n in PASS_ROWS:
            times, equal, gap = [], True, 0.0
            for r in range(REPEATS):
                at = r * n
                if at + n > len(single):
                    break
                be.truncate(prompt_n + at)
                t = time.perf_counter()
                rows = be.eval(rest[at : at + n], copy=False)
                times.append(time.perf_counter() - t)
                equal &= bool(np.array_equal(rows, single[at : at + n]))
                gap = max(gap, float(np.abs(rows - single[at : at + n]).max()))
            verify[str(n)] = {"ms": round(1000 * min(times), 2), "bitwise": equal, "gap": gap}
        return {
            "describe": be.describe(),
            "prompt_tok_s": round(len(prompt) / prompt_s, 2),
            "decode_tok_s": round(len(rest) / decode_s, 2),
            "verify": verify,
            "bitwise": all(v["bitwise"] for v in verify.values()),
        }
    finally:
        be.close()


def run_kernels_bench(
    targets: list[Path], n_threads: int | None, prompt_n: int = 256, decode_n: int = 32
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "prompt_tokens": prompt_n,
        "decode_tokens": decode_n,
        "targets": {},
        "configs": list(CONFIGS),
    }
    for target in targets:
        rows: dict[str, Any] = {}
        for name, (tiled, repack, rule) in CONFIGS.items():
            print(f"[kernels] {target.name}: {name}", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "memspec_lab.bench.kernels", "--one", str(target)]
            cmd += ["--repack"] * repack + ["--rule"] * rule
            cmd += ["--n-threads", str(n_threads)] if n_threads else []
            cmd += ["--prompt-tokens", str(prompt_n), "--decode-tokens", str(decode_n)]
            env = os.environ | {"GGML_CPU_TILED_MM": tiled}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"{target.name} {name}: {done.stderr.strip()[-2000:]}")
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        base = rows["plain"]
        for row in rows.values():
            row["vs_plain"] = {
                "prompt": round(row["prompt_tok_s"] / base["prompt_tok_s"], 3),
                "decode": round(row["decode_tok_s"] / base["decode_tok_s"], 3),
                "verify": {
                    n: round(base["verify"][n]["ms"] / v["ms"], 3) for n, v in row["verify"].items()
                },
            }
        report["targets"][target.name] = rows
    return report


def print_table(report: dict[str, Any]) -> None:
    head = ["target", "config", "repacked", "bitwise", "prompt t/s", "decode t/s"]
    head += [f"v{n} ms" for n in PASS_ROWS]
    print(" | ".join(head))
    for target, rows in report["targets"].items():
        for name, r in rows.items():
            cells = [
                target,
                name,
                str(r["describe"].get("weight_repack", False)),
                str(r["bitwise"]),
            ]
            cells += [f"{r['prompt_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}"]
            cells += [f"{r['verify'][str(n)]['ms']:.1f}" for n in PASS_ROWS]
            print(" | ".join(cells))


def register(bsub: Any) -> None:
    k = bsub.add_parser(
        "kernels",
        help="prompt, decode and verify cost with repacked/tiled kernels on and off, and "
        "whether each keeps logits bit-exact",
    )
    k.add_argument("targets", nargs="+", help="GGUF files (names resolve in the models dir)")
    k.add_argument("--n-threads", type=int, help="CPU threads (default: all cores)")
    k.add_argument("--prompt-tokens", type=int, default=256, help="prompt processed in one pass")
    k.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded one by one")
    k.add_argument("--out", required=True, help="JSON report")
    k.set_defaults(func=cmd_kernels)


def cmd_kernels(args: argparse.Namespace) -> int:
    from memspec.paths import models_dir

    targets = [Path(t) if Path(t).exists() else models_dir() / t for t in args.targets]
    missing = [str(t) for t in targets if not t.exists()]
    if missing:
        raise SystemExit(f"no such model: {', '.join(missing)}")
    report = run_kernels_bench(targets, args.n_threads, args.prompt_tokens, args.decode_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    return 0


def _main() -> None:
    """One configuration in this process: `--one TARGET [--repack] [--rule]`, JSON on stdout."""
    p = argparse.ArgumentParser()
    p.add_argument("--one", required=True)
    p.add_argument("--repack", action="store_true")
    p.add_argument("--rule", action="store_true")
    p.add_argument("--n-threads", type=int)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    a = p.parse_args()
    row = measure(Path(a.one), a.repack, a.rule, a.n_threads, a.prompt_tokens, a.decode_tokens)
    print(json.dumps(row))


if __name__ == "__main__":
    _main()
