"""Prompt features for the acceptance predictor: cheap, sparse, computed once per request.

- hashed token unigrams and bigrams of the prompt (what the prompt is about);
- how repetitive the prompt is: the share of positions whose preceding 1/2/3-gram occurred
  earlier in the prompt. That is exactly what prompt lookup feeds on, and it predicts
  extraction/rewriting where the answer quotes the question;
- length, number of turns, distinct-token ratio;
- category-like cues from the last user message (code, math, extraction, writing, roleplay).
Generation context (position in the output) is a separate small one-hot, so the per-request
part is a fixed dot product and each round adds one weight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

FEATURES_VERSION = 1
HASH_DIM = 512
# Output positions are bucketed: acceptance drifts as the answer builds up its own context.
POS_EDGES = (16, 32, 64, 128)

CUES: dict[str, tuple[str, ...]] = {
    "code": (
        "code",
        "python",
        "function",
        "program",
        "implement",
        "algorithm",
        "```",
        "c++",
        "java",
        "sql",
        "bug",
        "regex",
    ),
    "math": (
        "calculate",
        "solve",
        "equation",
        "probability",
        "integer",
        "sum of",
        "area",
        "prove",
        "=",
        "x^",
    ),
    "extract": (
        "extract",
        "json",
        "format",
        "following",
        "identify",
        "table",
        "list all",
        "return",
        "output",
        "csv",
    ),
    "rewrite": (
        "rewrite",
        "rephrase",
        "revise",
        "edit",
        "correct",
        "translate",
        "summarize",
        "summarise",
        "paraphrase",
    ),
    "writing": (
        "write",
        "essay",
        "story",
        "poem",
        "blog",
        "email",
        "letter",
        "draft",
        "compose",
        "speech",
    ),
    "roleplay": ("pretend", "imagine", "act as", "you are", "role", "character", "embrace"),
    "reason": ("why", "explain", "reason", "step by step", "how many", "what is"),
}
DENSE = (
    "log_len",
    "turns",
    "distinct",
    "rep1",
    "rep2",
    "rep3",
    *(f"cue_{c}" for c in CUES),
    "digits",
)
N_FEATURES = HASH_DIM + len(DENSE)


@dataclass(frozen=True)
class PromptFeatures:
    """Sparse feature vector: unique indices and their values."""

    idx: np.ndarray  # int64, sorted
    val: np.ndarray  # float64
    sq_norm: float

    def dot(self, w: np.ndarray) -> float:
        return float(w[self.idx] @ self.val)


_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: cheap, well spread


def _hash(codes: np.ndarray) -> np.ndarray:
    h = (codes.astype(np.uint64) * _MUL) >> np.uint64(40)
    return (h % np.uint64(HASH_DIM)).astype(np.int64)


def _ngram_codes(arr: np.ndarray, n: int) -> np.ndarray:
    code = np.zeros(len(arr) - n + 1, dtype=np.int64)
    for j in range(n):
        code = code * 1_000_003 + arr[j : len(arr) - n + 1 + j]
    return code


def _repetition(arr: np.ndarray, n: int) -> float:
    """Share of positions whose preceding n-gram already occurred earlier in the sequence."""
    if len(arr) <= n:
        return 0.0
    codes = _ngram_codes(arr[:-1], n)  # the n-gram ending just before each position j >= n
    return (len(codes) - len(np.unique(codes))) / len(codes)


def prompt_features(tokens: list[int], text: str = "", turns: int = 1) -> PromptFeatures:
    """Features of one request: its prompt tokens, the last user message, the turn count."""
    arr = np.asarray(tokens, dtype=np.int64)
    feats: dict[int, float] = {}
    if len(arr):
        grams = [arr * 2 + 1]  # odd codes: unigrams; even: bigrams (no collisions between them)
        if len(arr) > 1:
            grams.append(_ngram_codes(arr, 2) * 2)
        buckets = np.unique(_hash(np.concatenate(grams)))
        # Binary presence, L2-normalised: long prompts do not swamp the dense features.
        norm = 1.0 / math.sqrt(len(buckets))
        feats = dict.fromkeys(buckets.tolist(), norm)
    low = text.lower()
    dense = {
        "log_len": math.log1p(len(arr)) / 8.0,
        "turns": min(turns, 4) / 2.0,
        "distinct": len(np.unique(arr)) / max(len(arr), 1),
        "rep1": _repetition(arr, 1),
        "rep2": _repetition(arr, 2),
        "rep3": _repetition(arr, 3),
        "digits": min(len(re.findall(r"\d", text)) / 20.0, 1.0),
    }
    for cue, words in CUES.items():
        dense[f"cue_{cue}"] = min(sum(low.count(w) for w in words), 3) / 3.0
    for j, name in enumerate(DENSE):
        if dense[name]:
            feats[HASH_DIM + j] = dense[name]
    idx = np.array(sorted(feats), dtype=np.int64)
    val = np.array([feats[i] for i in idx.tolist()], dtype=np.float64)
    return PromptFeatures(idx, val, float(val @ val))


def pos_bucket(position: int) -> int:
    for b, edge in enumerate(POS_EDGES):
        if position < edge:
            return b
    return len(POS_EDGES)


N_POS = len(POS_EDGES) + 1
