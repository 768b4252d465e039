"""Retrieval draft: longest-suffix match in a token datastore (REST / suffix-decoding style).

Three sources are searched each round, and the longest match wins:
- the *base* index: a suffix array over a corpus (the target's own outputs on seed prompts,
  package text), loaded from a `.npz` file built by `memspec drafts build`;
- *recent* outputs: finished generations the daemon has seen, in a FIFO buffer bounded by a
  byte cap (oldest dropped first);
- the *context* itself (prompt + output so far), like prompt lookup.

A proposal walks the suffix tree below the match: at each step it takes the most frequent next
token among all occurrences of the matched string, narrows to those occurrences, and goes on
until k tokens, the end of a document, or too little support. The proposal key names the
source and match length (e.g. "datastore/b4", "datastore/c6") so the engine's acceptance
estimate is conditioned on what the draft knew. Proposals are deterministic (probs None).

Suffix array layout: `tokens` (big-endian uint32, documents separated by SEP) and `sa` (int32
start positions sorted by their first DEPTH tokens): 8 bytes per token, in the file and in
memory. Lookups are binary searches comparing byte strings — big-endian byte order equals the
tokens' numeric order — so Python's bisect does the work without a copy of the corpus.
"""

from __future__ import annotations

import bisect
import json
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memspec.drafts.compat import TokenizerFingerprint
from memspec.drafts.prompt_lookup import (
    MARK_TOKENS,
    RUN_CAP,
    PromptLookupDraft,
    key_match,
    match_bucket,
    run_length,
)
from memspec.engine.sampling import SamplingParams
from memspec.engine.types import Proposal
from memspec.errors import ModelLoadError

SEP = 0xFFFFFFFF  # document separator: larger than any token, never part of a pattern
DEPTH = 64  # suffixes are sorted by this many tokens: max match + longest walk must fit
# 2: the metadata records the fingerprint of the tokenizer the tokens are ids of ("tokenizer").
# Format 1 files still load, but no target accepts them (memspec.drafts.compat): rebuild.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
SAMPLE = 1024  # at most this many occurrences are read to pick the next token
SMALL = 32  # ranges this small are walked in plain Python (numpy calls cost more)
TAIL_AT_ONCE = 4096  # a tail match over at most this many (candidate, length) cells: one pass
# First-token acceptance by match length 0..8 for an index without a measured table (corpus,
# context): `calibrate_alpha` on held-out answers of SmolLM2-135M to seed prompts, 18k tokens.
DEFAULT_ALPHA = (
    [0.0, 0.13, 0.31, 0.44, 0.44, 0.74, 0.67, 0.72, 0.91],
    [0.0, 0.22, 0.50, 0.63, 0.72, 0.68, 0.81, 0.91, 0.92],
)


def build_suffix_array(tokens: np.ndarray, depth: int = DEPTH) -> np.ndarray:
    """Start positions sorted by their first `depth` tokens (prefix doubling, O(N log N log d)).

    Order beyond `depth` tokens is unspecified; a suffix running off the end sorts before any
    longer one with the same prefix (as bytes comparison does).
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64) + 1  # 0 means "past the end"
    sa = np.argsort(rank, kind="stable")
    h = 1
    while h < depth:
        nxt = np.zeros(n, dtype=np.int64)
        nxt[: n - h] = rank[h:]
        key = rank * (n + 2) + nxt
        sa = np.argsort(key, kind="stable")
        sk = key[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.cumsum(np.concatenate(([1], sk[1:] != sk[:-1])))
        rank = new
        if rank[sa[-1]] == n:  # all distinct: fully sorted
            break
        h *= 2
    return sa.astype(np.int32)


def _mode_sorted(col: np.ndarray) -> tuple[int, int]:
    """(value, count) of the most frequent value in a sorted array (ties: smallest value)."""
    edges = np.flatnonzero(col[1:] != col[:-1]) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [len(col)]))
    i = int(np.argmax(ends - starts))
    return int(col[starts[i]]), int(ends[i] - starts[i])


def _mode(col: np.ndarray) -> tuple[int, int]:
    """(value, count) of the most frequent value in an array (ties: smallest value). A few
    values are counted in plain Python: a sort per walk step (np.unique) made a lookup in a
    repetitive context cost 0.3 ms a round."""
    if len(col) > SMALL:
        return _mode_sorted(np.sort(col))
    counts: dict[int, int] = {}
    for t in col.tolist():
        counts[t] = counts.get(t, 0) + 1
    tok = min(counts, key=lambda t: (-counts[t], t))
    return tok, counts[tok]


class SuffixIndex:
    """Immutable suffix-array index over a token array with SEP between documents."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray | None = None, depth: int = DEPTH):
        # A trailing SEP lets a walk read one past any suffix without a bounds check.
        if len(tokens) == 0 or tokens[-1] != SEP:
            tokens = np.concatenate((np.asarray(tokens, np.uint32), np.array([SEP], np.uint32)))
        self.tokens = np.ascontiguousarray(tokens, dtype=">u4")
        self.depth = depth
        # copy=False: a loaded array is already int32; a second copy doubled the load's peak.
        self.sa = build_suffix_array(self.tokens, depth) if sa is None else sa
        self.sa = self.sa.astype(np.int32, copy=False)
        self._buf = memoryview(self.tokens.view(np.uint8))
        self._sa_mv = memoryview(self.sa)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.sa.nbytes

    def __len__(self) -> int:
        return len(self.tokens)

    def _range(self, pat: bytes, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """SA index range of suffixes starting with `pat` (big-endian uint32 bytes)."""
        n = len(pat)
        buf = self._buf

        def key(s: int) -> bytes:
            return buf[4 * s : 4 * s + n].tobytes()

        hi = len(self.sa) if hi is None else hi
        lo = bisect.bisect_left(self._sa_mv, pat, lo, hi, key=key)
        if lo >= hi or key(self._sa_mv[lo]) != pat:
            return lo, lo
        return lo, bisect.bisect_right(self._sa_mv, pat, lo, hi, key=key)

    def longest_match(
        self, context: list[int], max_match: int, since: BaseMatch | None = None
    ) -> tuple[int, int, int]:
        """(match length m, SA lo, SA hi) for the longest tail of `context` found (m ≥ 1).

        `since`: this index's answer for an earlier state of the same list, which `context`
        extends by j tokens. No tail longer than its m + j can occur (its first m + 1 tokens
        would have been a longer match then), and the match grown by the j tokens starts where
        it did, so its range nests in the earlier one: a round whose draft was accepted costs
        one search in a narrow range, not a binary search over m of whole-array searches."""
        max_match = min(max_match, len(context), self.depth - 1)
        if max_match <= 0:
            return 0, 0, 0
        tail = np.asarray(context[-max_match:], dtype=">u4").tobytes()
        hi_m = max_match
        if since is not None and len(context) >= since.n:
            grown = since.m + len(context) - since.n  # the last match and the new tokens
            hi_m = min(max_match, grown)
            if hi_m <= 0:
                return 0, 0, 0
            nested = since.m > 0 and grown == hi_m
            a, b = self._range(tail[4 * (max_match - hi_m) :], *(since.range if nested else ()))
            if b > a:
                return hi_m, a, b
            hi_m -= 1
        best = (0, 0, 0)
        lo_m = 1
        while lo_m <= hi_m:  # "the last m tokens occur" is monotone in m: binary search m
            m = (lo_m + hi_m) // 2
            a, b = self._range(tail[4 * (max_match - m) :])
            if b > a:
                best = (m, a, b)
                lo_m = m + 1
            else:
                hi_m = m - 1
        return best

    def walk(self, lo: int, hi: int, m: int, k: int, min_count: int, min_share: float) -> list[int]:
        """Most frequent continuation path below the SA range [lo, hi) matched to depth m."""
        out: list[int] = []
        tokens, sa = self.tokens, self.sa
        pat = tokens[sa[lo] : sa[lo] + m].tobytes()  # big-endian already: the search key
        while len(out) < k and m + 1 < self.depth and hi > lo:
            if hi - lo <= SMALL:
                return out + self._walk_small(
                    lo, hi, m, min(k - len(out), self.depth - 1 - m), min_count, min_share
                )
            step = max(1, (hi - lo) // SAMPLE)  # sorted column: an even sample keeps the mode
            col = tokens[sa[lo:hi:step] + m]
            tok, cnt = _mode_sorted(col)
            total = len(col)
            if tok == SEP or cnt * step < min_count or cnt < min_share * total:
                break
            out.append(tok)
            pat += tok.to_bytes(4, "big")
            m += 1
            if step == 1:
                # Exact: the run of `tok` in the sorted column is the narrowed range.
                first = int(np.searchsorted(col, tok, "left"))
                lo, hi = lo + first, lo + first + cnt
            else:
                lo, hi = self._range(pat, lo, hi)
        return out

    def _walk_small(
        self, lo: int, hi: int, m: int, k: int, min_count: int, min_share: float
    ) -> list[int]:
        """The same walk for a few occurrences: read all their next k tokens at once."""
        starts = self.sa[lo:hi].astype(np.int64) + m
        idx = np.minimum(starts[:, None] + np.arange(k), len(self.tokens) - 1)
        rows = self.tokens[idx].tolist()  # past the end reads the final SEP
        if len(rows) == 1 and min_count <= 1 and min_share <= 1.0:  # one occurrence: its path
            path = rows[0]
            return path[: path.index(SEP)] if SEP in path else path
        out: list[int] = []
        for j in range(k):
            counts: dict[int, int] = {}
            for r in rows:
                counts[r[j]] = counts.get(r[j], 0) + 1
            tok, cnt = min(counts.items(), key=lambda tc: (-tc[1], tc[0]))
            if tok == SEP or cnt < min_count or cnt < min_share * len(rows):
                break
            out.append(tok)
            rows = [r for r in rows if r[j] == tok]
        return out


def _tail_match(
    arr: np.ndarray, context: list[int], max_match: int, at_once: int = TAIL_AT_ONCE
) -> tuple[int, np.ndarray]:
    """Longest tail of `context` occurring in `arr` followed by ≥1 token: (m, end positions).
    `at_once`: the most (candidate, length) cells matched in one pass."""
    if len(arr) < 2 or not context:
        return 0, np.zeros(0, dtype=np.int64)
    cand = np.flatnonzero(arr[:-1] == context[-1])  # position of the matched tail's last token
    limit = min(max_match, len(context))
    if not cand.size or limit == 1:
        return int(cand.size > 0), cand
    if cand.size * limit <= at_once:
        # Every candidate's run backwards at once (a repeated context had 16 rounds of
        # filtering, ~0.1 ms): the first mismatch in each row ends its run.
        want = np.asarray(context[-limit:][::-1], dtype=arr.dtype)
        at = cand[:, None] - np.arange(limit)
        ok = (at >= 0) & (arr[np.maximum(at, 0)] == want)
        runs = np.where(ok.all(axis=1), limit, ok.argmin(axis=1))
        m = int(runs.max())
        return m, cand[runs == m]
    m = 1  # many candidates: filtered a step at a time, most fall at the first
    while m < limit:
        prev = cand - m
        ok = prev >= 0
        ok[ok] = arr[prev[ok]] == context[-1 - m]
        if not ok.any():
            break
        cand, m = cand[ok], m + 1
    return m, cand


@dataclass(frozen=True)
class BaseMatch:
    """The base index's longest match for a context of n tokens: length m, SA range."""

    n: int
    m: int
    lo: int
    hi: int

    @property
    def range(self) -> tuple[int, int]:
        return self.lo, self.hi


@dataclass
class _Tracked:
    context: list[int]
    buf: np.ndarray  # uint32, its first n the context's
    n: int  # tokens converted
    mark: list[int]  # the last MARK_TOKENS of those, as they were
    match: BaseMatch | None = None


class TrackedContexts:
    """What a lookup learned about each context, kept across rounds: each round the engine
    asks with the same list grown by a few tokens. Its uint32 array is converted by the new
    tokens only (a 600-token list whole cost ~40 µs a round, more as it grows), and the base
    index's last match narrows the next one's search (SuffixIndex.longest_match). One entry
    per list, the few most recent (a batch's sequences each ask with their own); a list
    edited where its last conversion ended starts over."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self._entries: dict[int, _Tracked] = {}  # id(list) -> its entry

    def array(self, context: list[int]) -> np.ndarray:
        """The context as uint32 (a view: valid until the next call for this list)."""
        e = self._entries.pop(id(context), None)
        if e is None or e.context is not context:
            e = _Tracked(context, np.zeros(0, np.uint32), 0, [])
        elif e.n > len(context) or context[max(e.n - MARK_TOKENS, 0) : e.n] != e.mark:
            e.n, e.match = 0, None
        n = len(context)
        if n > len(e.buf):
            grown = np.empty(max(2 * len(e.buf), n, 64), np.uint32)
            grown[: e.n] = e.buf[: e.n]
            e.buf = grown
        if n > e.n:
            e.buf[e.n : n] = context[e.n :]
        e.n, e.mark = n, context[max(n - MARK_TOKENS, 0) : n]
        self._entries[id(context)] = e
        while len(self._entries) > self.keep:  # the least recently asked goes first
            del self._entries[next(iter(self._entries))]
        return e.buf[:n]

    def match(self, context: list[int]) -> BaseMatch | None:
        """The base match remembered for an earlier state of this list (array() first)."""
        e = self._entries.get(id(context))
        return e.match if e is not None and e.context is context else None

    def remember_match(self, context: list[int], m: int, lo: int, hi: int) -> None:
        e = self._entries.get(id(context))
        if e is not None and e.context is context:
            e.match = BaseMatch(len(context), m, lo, hi)


def _linear_walk(
    arr: np.ndarray,
    cand: np.ndarray,
    k: int,
    min_count: int,
    min_share: float,
    prefer_latest: bool,
) -> list[int]:
    out: list[int] = []
    while len(out) < k and cand.size:
        nxt = cand + 1
        nxt = nxt[nxt < len(arr)]
        if not nxt.size:
            break
        col = arr[nxt]
        tok, cnt = _mode(col)
        if prefer_latest and cnt == 1:
            tok = int(col[-1])  # no repeat to vote with: copy the latest occurrence
        if tok == SEP or cnt < min_count or cnt < min_share * len(col):
            break
        out.append(tok)
        cand = nxt[col == tok]
    return out


class DatastoreDraft(PromptLookupDraft):
    """A lookup draft (so the engine peeks it each round like prompt lookup: it is free)."""

    kind = "datastore"

    def __init__(
        self,
        id: str,
        index: SuffixIndex | None,
        *,
        max_match: int = 16,
        min_match: int = 2,
        min_count: int = 1,
        min_share: float = 0.0,
        use_context: bool = True,
        recent_bytes: int = 1 << 20,
        learn: bool = True,
        min_alpha: float = 0.0,
        meta: dict | None = None,
    ):
        self.id = id
        self.index = index
        self.max_match = max_match
        self.min_match = min_match
        self.min_count = min_count
        self.min_share = min_share
        self.use_context = use_context
        self.recent_bytes = recent_bytes  # byte cap on remembered outputs
        self.learn = learn
        self.meta = meta or {}
        # Don't propose from a match whose kind is accepted less often than this.
        self.min_alpha = min_alpha
        # First-token acceptance by match length, measured when the index was built.
        self.alpha_table: dict[str, list[float]] = dict(self.meta.get("alpha_by_match", {}))
        self._recent: deque[np.ndarray] = deque()
        self._recent_arr = np.array([SEP], dtype=np.uint32)
        self._contexts = TrackedContexts()
        self._recent_used = 0
        self._req_prompt: list[int] | None = None  # prompt of the request being decoded
        self._req_ctx: list[int] | None = None  # its context as last seen

    @property
    def tokenizer(self) -> TokenizerFingerprint | None:
        """The tokenizer its index was built with (None: built before format 2, unknown)."""
        d = self.meta.get("tokenizer")
        try:
            return TokenizerFingerprint.from_dict(d) if d else None
        except ValueError:
            return None

    # --- past outputs ---------------------------------------------------------------------
    def remember(self, tokens: list[int]) -> None:
        """Add a finished generation to the recent store; drop the oldest past the byte cap."""
        if not tokens:
            return
        arr = np.asarray(tokens, dtype=np.uint32)
        if arr.nbytes + 4 > self.recent_bytes:
            arr = arr[-(self.recent_bytes // 4 - 1) :]
        self._recent.append(arr)
        self._recent_used += arr.nbytes + 4  # + its separator
        while self._recent_used > self.recent_bytes:
            old = self._recent.popleft()
            self._recent_used -= old.nbytes + 4
        parts = [np.array([SEP], np.uint32)]
        for a in self._recent:
            parts += [a, np.array([SEP], np.uint32)]
        self._recent_arr = np.concatenate(parts)

    @property
    def recent_tokens(self) -> int:
        return sum(len(a) for a in self._recent)

    def _track_request(self, context: list[int]) -> None:
        """Notice a new request and remember the previous one's output.

        The engine calls propose with the growing context of one request; a context that does
        not extend the last request's prompt starts a new request.
        """
        prompt = self._req_prompt
        if prompt is not None and len(context) >= len(prompt) and context[: len(prompt)] == prompt:
            self._req_ctx = context
            return
        if prompt is not None and self._req_ctx is not None:
            self.remember(self._req_ctx[len(prompt) :])
        self._req_prompt = list(context)
        self._req_ctx = context

    def finish_request(self, output: list[int] | None = None) -> None:
        """Remember a finished request's output now (the runtime calls this at its end).

        `output` is the whole generated text; without it, what the last proposal saw.
        """
        if output is not None:
            if self.learn and output:
                self.remember(list(output))
        elif self._req_prompt is not None and self._req_ctx is not None:
            self.remember(self._req_ctx[len(self._req_prompt) :])
        self._req_prompt = self._req_ctx = None

    # --- proposals ------------------------------------------------------------------------
    def find(self, context: list[int], k: int) -> tuple[list[int], int]:
        tokens, _, m = self.lookup(context, k)
        return tokens, m

    def quality(self, src: str, m: int) -> float:
        """Share of first proposed tokens accepted for a match of length m in source src."""
        table = self.alpha_table.get("c" if src == "c" else "b") or DEFAULT_ALPHA[src == "c"]
        return float(table[min(m, len(table) - 1)])

    def lookup(self, context: list[int], k: int) -> tuple[list[int], str, int]:
        """(tokens, source, match length): source "c" context, "r" recent, "b" base index."""
        found: dict[str, tuple[int, object]] = {}  # source -> (match length, where)
        ctx = self._contexts.array(context)
        if self.use_context and len(context) > 1:
            # cand indexes ctx[:-1]: the token after each is in ctx (never the tail itself)
            m, cand = _tail_match(ctx[:-1], context, self.max_match)
            if m >= self.min_match:
                found["c"] = (m, (ctx, cand))
        if self._recent:
            m, cand = _tail_match(self._recent_arr, context, self.max_match)
            if m >= self.min_match:
                found["r"] = (m, (self._recent_arr, cand))
        if self.index is not None:
            since = self._contexts.match(context)
            m, lo, hi = self.index.longest_match(context, self.max_match, since)
            self._contexts.remember_match(context, m, lo, hi)
            if m >= self.min_match:
                found["b"] = (m, (lo, hi))
        if not found:
            return [], "", 0
        # The source whose matches of this length were accepted most often: a 2-token match in
        # the context beats a 3-token one in the corpus (the answer is repeating itself).
        src = max(found, key=lambda s: (self.quality(s, found[s][0]), found[s][0]))
        m, where = found[src]
        if self.quality(src, m) < self.min_alpha:
            return [], src, m
        if src == "b":
            lo, hi = where  # type: ignore[misc]
            assert self.index is not None
            return self.index.walk(lo, hi, m, k, self.min_count, self.min_share), src, m
        arr, cand = where  # type: ignore[misc]
        # In the context the latest occurrence is the best guess (what is being repeated).
        toks = _linear_walk(arr, cand, k, 1, self.min_share, prefer_latest=src == "c")
        if src == "c" and m >= self.max_match:
            # The search stops at max_match; a copy of a file runs back much further, and the
            # rule drafts deeper on the matches that do (prompt_lookup's match length).
            last, n = int(cand[-1]), len(context)
            m += run_length(context, last - m, n - 1 - m, RUN_CAP - m)
        return toks, src, m

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        if self.learn:
            self._track_request(context)
        if k <= 0:
            return Proposal(key=self.id)
        tokens, src, m = self.lookup(context, k)
        # Acceptance grows with match length, and so does the k the rule drafts at: keyed by
        # the length's bucket (memspec.drafts.prompt_lookup, the rule for k).
        key = f"{self.id}/{src or 'b'}{match_bucket(m)}"
        # Only a context match is a copy (Proposal.match, prompt_lookup.key_match): the
        # index's and the recent outputs' matches are retrieval, their acceptance their own.
        return Proposal(tokens=tokens, probs=None, key=key, match=key_match(key))

    def memory_bytes(self) -> int:
        base = self.index.nbytes if self.index is not None else 0
        return base + self._recent_arr.nbytes

    # --- files ----------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        save_index(path, self.index or SuffixIndex(np.zeros(0, np.uint32)), self.meta)


def save_index(path: Path, index: SuffixIndex, meta: dict) -> None:
    """Write tokens + suffix array + metadata as one uncompressed .npz at exactly `path`."""
    info = {**meta, "format": FORMAT_VERSION, "depth": index.depth, "n_tokens": len(index)}
    with Path(path).open("wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(
            f,
            tokens=index.tokens,
            sa=index.sa,
            meta=np.frombuffer(json.dumps(info, sort_keys=True).encode(), dtype=np.uint8),
        )


def load_index(path: Path) -> tuple[SuffixIndex, dict]:
    """Load and validate a datastore file; any damage is a ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"datastore file not found: {path}", param="model")
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens = z["tokens"]
            sa = z["sa"]
            meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ModelLoadError(f"corrupt datastore {path.name}: {e}", param="model") from e
    n = len(tokens)
    ok = (
        isinstance(meta, dict)
        and meta.get("format") in READABLE_FORMATS
        and tokens.dtype == np.dtype(">u4")
        and sa.dtype == np.int32
        and tokens.ndim == sa.ndim == 1
        and len(sa) == n
        and n > 0
        and tokens[-1] == SEP
        and int(sa.min()) >= 0
        and int(sa.max()) < n
    )
    if not ok:
        raise ModelLoadError(f"corrupt datastore {path.name}: bad arrays or format", param="model")
    return SuffixIndex(tokens, sa, int(meta.get("depth", DEPTH))), meta


def read_meta(path: Path) -> dict:
    """A datastore file's metadata alone (its tokenizer, its source), without the index."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"datastore file not found: {path}", param="model")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ModelLoadError(f"corrupt datastore {path.name}: {e}", param="model") from e
    if not isinstance(meta, dict):
        raise ModelLoadError(f"corrupt datastore {path.name}: bad metadata", param="model")
    return meta


def load_datastore(id: str, path: Path, params: dict | None = None) -> DatastoreDraft:
    index, meta = load_index(path)
    p = params or {}
    return DatastoreDraft(
        id,
        index,
        max_match=int(p.get("max_match", 16)),
        min_match=int(p.get("min_match", 2)),
        min_count=int(p.get("min_count", 1)),
        min_share=float(p.get("min_share", 0.0)),
        use_context=bool(int(p.get("use_context", 1))),
        recent_bytes=int(p.get("recent_bytes", 1 << 20)),
        learn=bool(int(p.get("learn", 1))),
        min_alpha=float(p.get("min_alpha", 0.0)),
        meta=meta,
    )


def build_index(documents: list[list[int]], max_tokens: int | None = None) -> SuffixIndex:
    """Concatenate documents (SEP between) up to max_tokens and index them."""
    parts: list[np.ndarray] = []
    used = 0
    for doc in documents:
        if not doc:
            continue
        if max_tokens is not None and used + len(doc) + 1 > max_tokens:
            doc = doc[: max(0, max_tokens - used - 1)]
            if not doc:
                break
        parts += [np.asarray(doc, dtype=np.uint32), np.array([SEP], np.uint32)]
        used += len(doc) + 1
    tokens = np.concatenate(parts) if parts else np.array([SEP], np.uint32)
    return SuffixIndex(tokens)


def calibrate_alpha(
    index: SuffixIndex, heldout: list[list[int]], max_match: int = 16, k: int = 8
) -> dict[str, list[float]]:
    """First-token acceptance by match length (0..8) per source, replaying held-out answers.

    At each position of each held-out answer the index ("b") and the answer so far ("c") are
    asked for a continuation as the draft would be; an entry is the share of those whose first
    token is the answer's next token.
    """
    hits = {"b": np.zeros(9), "c": np.zeros(9)}
    seen = {"b": np.zeros(9), "c": np.zeros(9)}
    for doc in heldout:
        arr = np.asarray(doc, dtype=np.uint32)
        for i in range(2, len(doc)):
            ctx = doc[:i]
            m, lo, hi = index.longest_match(ctx, max_match)
            if m:
                toks = index.walk(lo, hi, m, 1, 1, 0.0)
                seen["b"][min(m, 8)] += 1
                hits["b"][min(m, 8)] += bool(toks) and toks[0] == doc[i]
            m, cand = _tail_match(arr[: i - 1], ctx, max_match)
            if m:
                toks = _linear_walk(arr[:i], cand, 1, 1, 0.0, prefer_latest=True)
                seen["c"][min(m, 8)] += 1
                hits["c"][min(m, 8)] += bool(toks) and toks[0] == doc[i]
    out: dict[str, list[float]] = {}
    for src, default in (("b", DEFAULT_ALPHA[0]), ("c", DEFAULT_ALPHA[1])):
        # Too few cases to trust (small builds): the default for that length.
        out[src] = [
            round(float(hits[src][m] / seen[src][m]), 3) if seen[src][m] >= 30 else default[m]
            for m in range(9)
        ]
    return out
