"""The MT-Bench workloads traces are collected on and policies are benchmarked on.

A request is one turn of one question. Turn 2 is asked after the target's own (plain, greedy)
answer to turn 1, so its prompt is known only once turn 1 has been decoded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from memspec.testbed import load_mtbench


@dataclass(frozen=True)
class RequestSpec:
    question_id: int
    category: str
    turn: int  # 1 or 2
    turns: tuple[str, ...]  # the question's user turns

    @property
    def id(self) -> str:
        return f"q{self.question_id}-t{self.turn}"


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


def requests_for(questions: list[dict], turns: int = 2) -> list[RequestSpec]:
    """Both turns of each question, turn 1 first (turn 2's prompt depends on it)."""
    out = []
    for q in questions:
        for t in range(1, turns + 1):
            out.append(RequestSpec(q["question_id"], q["category"], t, tuple(q["turns"])))
    return out


def mixed_order(requests: list[RequestSpec], run_questions: int = 2) -> list[RequestSpec]:
    """Categories interleaved in runs: `run_questions` questions (all their turns) of one
    category, then the next category, cycling until every request is placed. The workload's
    category changes over time, which is what a residency policy has to follow."""
    by_cat: dict[str, list[list[RequestSpec]]] = defaultdict(list)
    for r in requests:
        convs = by_cat[r.category]
        if not convs or convs[-1][0].question_id != r.question_id:
            convs.append([])
        convs[-1].append(r)
    order: list[RequestSpec] = []
    cats = list(by_cat)
    while any(by_cat.values()):
        for c in cats:
            for _ in range(run_questions):
                if by_cat[c]:
                    order.extend(by_cat[c].pop(0))
    return order
