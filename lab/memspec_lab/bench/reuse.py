"""`memspec bench reuse`: MT-Bench second-turn time-to-first-token with and without KV reuse.

For each question: turn 1 is answered (greedy, `max_tokens`), then turn 2 (user 1, assistant
answer, user 2) is measured three ways, all plain target decoding so only the prefill differs:

- cold: the KV cache emptied first, the whole conversation prefilled (no reuse);
- live: straight after turn 1, the engine reuses the KV prefix it still holds;
- interleaved: every question's turn 1 first, then every turn 2, so each conversation's KV
  was displaced by the others and comes back only through the multi-session prefix cache
  (the daemon's own PrefixCache, restored before the prefill; restore time included).

TTFT is the engine's: prefill + the first decode round (no HTTP, no queue).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from memspec.config import Settings
from memspec.engine.prefix_cache import PrefixCache
from memspec.engine.sampling import SamplingParams
from memspec.units import parse_size
from memspec_lab.testbed import load_mtbench

TTFT_TOKENS = 4  # the second turn only needs its first token; a few more cost little


def pick_questions(n: int) -> list[dict]:
    """n questions, round-robin over the categories (so a small n still covers them all)."""
    by_cat: dict[str, list[dict]] = {}
    for q in load_mtbench():
        by_cat.setdefault(q["category"], []).append(q)
    out: list[dict] = []
    while len(out) < n and any(by_cat.values()):
        for qs in by_cat.values():
            if qs and len(out) < n:
                out.append(qs.pop(0))
    return out


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else 0.0


def run_reuse_bench(
    settings: Settings, out: str | Path, questions: int = 16, max_tokens: int = 128
) -> dict[str, Any]:
    from memspec.runtime import Runtime

    rt = Runtime(settings)
    cap = parse_size(settings.prefix_cache)
    cache = PrefixCache(lambda: cap)
    first = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    probe = SamplingParams(max_tokens=TTFT_TOKENS, temperature=0.0)
    rows: list[dict[str, Any]] = []
    try:
        qs = pick_questions(questions)
        convs = []
        for q in qs:
            u1, u2 = q["turns"][0], q["turns"][1]
            p1 = rt.requests.prompt_tokens(messages=[{"role": "user", "content": u1}])
            rt.target.reset()
            turn1 = rt.generate(p1, first, draft="none")
            a1 = turn1.text
            msgs = [
                {"role": "user", "content": u1},
                {"role": "assistant", "content": a1},
                {"role": "user", "content": u2},
            ]
            p2 = rt.requests.prompt_tokens(messages=msgs)
            live = rt.generate(p2, probe, draft="none")
            rt.target.reset()
            cold = rt.generate(p2, probe, draft="none")
            convs.append((p1 + turn1.token_ids, p2))
            rows.append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "turn1_prompt_tokens": len(p1),
                    "turn2_prompt_tokens": len(p2),
                    "ttft_cold_s": round(cold.ttft_s, 4),
                    "ttft_live_s": round(live.ttft_s, 4),
                    "cached_live": live.cached_tokens,
                }
            )
        # Interleaved: every first turn again (its prompt and answer tokens, prefilled; each
        # displaces the previous conversation's KV into the prefix cache), then every second
        # turn (restored from it).
        rt.target.reset()
        for turn1_tokens, _ in convs:
            rt.prepare_prefix(cache, turn1_tokens, use_drafts=False)
            rt.generate(turn1_tokens, probe, draft="none")
        peak = cache.nbytes
        for row, (_, p2) in zip(rows, convs, strict=True):
            t0 = time.perf_counter()
            restored = rt.prepare_prefix(cache, p2, use_drafts=False)
            restore_s = time.perf_counter() - t0
            gen = rt.generate(p2, probe, draft="none")
            peak = max(peak, cache.nbytes)
            row["ttft_interleaved_s"] = round(restore_s + gen.ttft_s, 4)
            row["restore_s"] = round(restore_s, 4)
            row["cached_interleaved"] = gen.cached_tokens
            row["restored"] = restored > 0
    finally:
        rt.close()

    def col(key: str) -> list[float]:
        return [r[key] for r in rows]

    cold, live, inter = col("ttft_cold_s"), col("ttft_live_s"), col("ttft_interleaved_s")
    summary = {
        "questions": len(rows),
        "first_turn_max_tokens": max_tokens,
        "turn2_prompt_tokens_median": _median(col("turn2_prompt_tokens")),
        "cached_live_median": _median(col("cached_live")),
        "ttft_cold_median_s": _median(cold),
        "ttft_live_median_s": _median(live),
        "ttft_interleaved_median_s": _median(inter),
        "speedup_live_median": _median([c / max(v, 1e-9) for c, v in zip(cold, live, strict=True)]),
        "speedup_live_total": round(sum(cold) / max(sum(live), 1e-9), 2),
        "speedup_interleaved_median": _median(
            [c / max(v, 1e-9) for c, v in zip(cold, inter, strict=True)]
        ),
        "speedup_interleaved_total": round(sum(cold) / max(sum(inter), 1e-9), 2),
        "interleaved_restored": sum(1 for r in rows if r["restored"]),
        "prefix_cache_capacity_bytes": cap,
        "prefix_cache_peak_bytes": peak,
    }
    report = {
        "bench": "reuse",
        "target": settings.target,
        "n_ctx": settings.n_ctx,
        "n_threads": settings.n_threads,
        "summary": summary,
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report
