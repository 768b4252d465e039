"""The MT-Bench workloads traces are collected on and policies are benchmarked on.

A request is one turn of one question. Turn 2 is asked after the target's own (plain, greedy)
answer to turn 1, so its prompt is known only once turn 1 has been decoded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    question_id: int
    category: str
    turn: int  # 1 or 2
    turns: tuple[str, ...]  # the question's user turns

    @property
    def id(self) -> str:
        return f"q{self.question_id}-t{self.turn}"


def requests_for(questions: list[dict], turns: int = 2) -> list[RequestSpec]:
    """Both turns of each question, turn 1 first (turn 2's prompt depends on it)."""
    out = []
    for q in questions:
        for t in range(1, turns + 1):
            out.append(RequestSpec(q["question_id"], q["category"], t, tuple(q["turns"])))
    return out
