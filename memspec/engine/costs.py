"""The decision rule: which (draft, k) — none included — gives the most tokens per second now.

tokens_per_round(α₁, α_c, k) = 1 + α₁ · (1 − α_c^k) / (1 − α_c)
seconds_per_round            = draft_cost(k) + verify_cost(k+1)
choose argmax tokens_per_round / seconds_per_round; plain decoding is k = 0

This module is the one place the rule lives (CostModel.rate / best_k, best_choice): the
engine's DecisionRulePolicy (every round of `auto` and `memspec`, live and simulated), the
scheduler's other policies and predictor training's best-draft metric all call it.

α₁ is the first drafted token's acceptance and α_c a later token's, given the one before it
was accepted. With α_c = α₁ this is the i.i.d. formula (1 − α^(k+1)) / (1 − α). Lookup
drafts need both: whether a retrieved continuation starts right is a coin flip, but once it
does it tends to run on (measured on MT-Bench replays: α₁ ≈ 0.45, α_c ≈ 0.8), and one
i.i.d. α fitted to that mix under-drafts the runs and over-drafts the misses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

D = TypeVar("D")  # whatever names a draft to the caller: an id, a Draft


@dataclass(frozen=True)
class RoundCosts:
    """One round as measured, what a CostModel corrects itself by."""

    draft_id: str | None  # the draft that proposed (None: no draft)
    drafted: int  # tokens it proposed: the target verified drafted + 1
    draft_s: float  # the draft's seconds, catch-up included
    catchup_tokens: int  # context tokens the draft fed before proposing
    verify_s: float  # the target's seconds verifying
    first_s: float = 0.0  # of draft_s, its first forward's (the catch-up); 0: not known
    context: int = 0  # the sequence's tokens when it was verified (its context band)


def expected_tokens(alpha: float, k: int, alpha_cont: float | None = None) -> float:
    """Expected tokens per round (accepted prefix + the target's own token) at α₁ = `alpha`,
    α_c = `alpha_cont` (default: `alpha`, i.e. i.i.d. tokens)."""
    c = alpha if alpha_cont is None else alpha_cont
    if k <= 0:
        return 1.0
    run = float(k) if c >= 1.0 else (1.0 - c**k) / (1.0 - c)
    return 1.0 + alpha * run


# A batched catch-up costs about this share of a one-token draft step per token (measured
# on the 2-core box: a 64-token prefill of q4_0 ≈ 16 single steps).
CATCHUP_SHARE = 0.25


# Weight of one round's measurement in the running cost estimates.
COST_EMA = 0.1


# Verify costs are learnt per context band: attention grows with rows × context and changes
# the curve's shape at long contexts, so one band's measurements say little about another's
# (Gemma 3 270M: 12.8 ms for one row and 91 for nine at 128 tokens of context; at 17k, 21.9
# and about 215 in use, where no draft pays). Band 0 holds every context below BAND_START.
BAND_START = 2048


def context_band(context: int) -> int:
    """0 below BAND_START tokens of context, then one band per doubling (2-4k is 1, 4-8k 2)."""
    return (max(context, 0) // BAND_START).bit_length()


@dataclass
class CostModel:
    """Costs on this device: verify_s[b-1] is the calibrated time for a target batch of b,
    draft_s a model draft's calibrated time per proposed token.

    Calibration happens once (and is cached), at a short context, but the machine changes
    (other load, thermal limits, a cache written while the box was busy) and so does the
    curve's shape with the context. So every round's measured verify and draft time corrects
    the estimates (observe), verify times per context band (context_band): a batch size seen
    in the band is estimated from its own running mean; one between two sizes seen from its
    calibration plus their excess over calibration, interpolated; one beyond them from its
    calibration times the nearest size's measured/calibrated ratio. A band with nothing
    measured yet borrows the nearest shorter band's measurements. Every decision reads the
    estimates of the moment: a verify estimate is kept only until the next round's
    measurement moves it (_verify_memo).
    """

    verify_s: list[float]
    draft_s: dict[str, float] = field(default_factory=dict)  # per proposed token
    draft_overhead_s: dict[str, float] = field(default_factory=dict)  # per round (lookup etc.)
    # Per context token a model draft feeds to catch up (batched), e.g. the prompt at its
    # first use in a request. Unknown: CATCHUP_SHARE of a draft step.
    prefill_s: dict[str, float] = field(default_factory=dict)
    # Batched decoding: seconds for one forward pass of n tokens spread over several sequence
    # slots, calibrated at a few n (memspec.engine.calibration.measure_batch); between them
    # interpolated, beyond them extended from the last two.
    batch_s: dict[int, float] = field(default_factory=dict)
    _batch_seen: dict[int, float] = field(default_factory=dict, repr=False)
    _verify_seen: dict[int, dict[int, float]] = field(default_factory=dict, repr=False)  # band
    _draft_seen: dict[str, float] = field(default_factory=dict, repr=False)
    # A round's first draft forward (it also feeds the target's correction token) as measured
    # in use. Where the draft's threads sat idle through a long verify (a target split over
    # RPC workers) it costs far more than a later step: measured 46 ms against 19 ms for q8_0.
    _first_seen: dict[str, float] = field(default_factory=dict, repr=False)
    # (band, batch) -> estimate, till observe()
    _verify_memo: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    # False while this device's costs are not measured yet (unknown(): a model the daemon
    # serves before its calibration has run): the rule then drafts nothing (best_k,
    # plan_batch), since costs it does not know would make every draft look free.
    known: bool = True

    @classmethod
    def alike(cls, k_max: int) -> CostModel:
        """Every batch size one second, every draft free: what a tool that skips calibration
        decodes with (`auto` then drafts every round it has a proposal)."""
        return cls(verify_s=[1.0] * (k_max + 1))

    @classmethod
    def unknown(cls, k_max: int) -> CostModel:
        """Not measured yet: plain decoding, until calibrated costs are adopted."""
        return cls(verify_s=[1.0] * (k_max + 1), known=False)

    def adopt(self, measured: CostModel) -> None:
        """Take the calibrated curves and draft costs of `measured`, in place (the scheduler
        and the rounds hold this object); what rounds measured meanwhile is kept."""
        self.verify_s = list(measured.verify_s)
        self.batch_s = dict(measured.batch_s)
        self.draft_s.update(measured.draft_s)
        self.draft_overhead_s.update(measured.draft_overhead_s)
        self.prefill_s.update(measured.prefill_s)
        self._verify_memo.clear()
        self.known = True

    def observe(self, m: RoundCosts) -> None:
        """One round as measured (RoundCosts): the verify and draft estimates move to it."""
        batch = m.drafted + 1
        if m.verify_s > 0:
            self._verify_memo.clear()
            band = self._verify_seen.setdefault(context_band(m.context), {})
            self._update(band, batch, m.verify_s)
        d = m.draft_id
        if d in self.draft_s and m.drafted > 0 and m.draft_s > 0 and m.catchup_tokens <= 2:
            if m.first_s <= 0:
                self._update(self._draft_seen, d, m.draft_s / m.drafted)
            else:  # the first forward and the later steps, each on its own
                self._update(self._first_seen, d, m.first_s)
                if m.drafted > 1:
                    steps = max(m.draft_s - m.first_s, 0.0) / (m.drafted - 1)
                    self._update(self._draft_seen, d, steps)

    def observe_batch(self, n_tokens: int, seconds: float) -> None:
        """One batched forward pass as measured (n_tokens over all its sequences)."""
        if seconds > 0:
            self._update(self._batch_seen, n_tokens, seconds)

    def batch(self, n_tokens: int) -> float:
        """Seconds for a forward pass of n_tokens over several sequences: measured in use,
        else calibrated (without a batch calibration: the single-sequence verify cost)."""
        if n_tokens in self._batch_seen:
            return self._batch_seen[n_tokens]
        if not self.batch_s:
            return self.verify(n_tokens)
        pts = sorted(self.batch_s.items())
        if n_tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, s0), (n1, s1) in zip(pts, pts[1:], strict=False):
            if n_tokens <= n1:
                return s0 + (s1 - s0) * (n_tokens - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2] if len(pts) > 1 else pts[-1], pts[-1]
        slope = (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0
        return s1 + slope * (n_tokens - n1)

    @staticmethod
    def _update(seen: dict, key: object, value: float) -> None:
        old = seen.get(key)
        seen[key] = value if old is None else old + COST_EMA * (value - old)

    def draft_cost(self, draft_id: str) -> float:
        """Seconds per proposed token: measured in use, else calibrated."""
        return self._draft_seen.get(draft_id, self.draft_s.get(draft_id, 0.0))

    def catchup_s(self, draft_id: str) -> float:
        return self.prefill_s.get(draft_id, CATCHUP_SHARE * self.draft_cost(draft_id))

    def with_catchup(self, rate: float, draft_id: str, gap: int, tokens_left: float) -> float:
        """A round's rate once catching up on `gap` context tokens, paid once, is spread over
        the tokens still expected (a small gap, the usual correction token, is a draft step)."""
        if gap <= 2 or rate <= 0:
            return rate
        return 1.0 / (1.0 / rate + self.catchup_s(draft_id) * gap / max(tokens_left, 1.0))

    def verify(self, batch: int, context: int = 0) -> float:
        """Seconds for the target to verify `batch` tokens at `context` tokens of context."""
        key = (context_band(context), batch)
        if key not in self._verify_memo:
            self._verify_memo[key] = self._estimate_verify(*key)
        return self._verify_memo[key]

    def _estimate_verify(self, band: int, batch: int) -> float:
        seen = self._band_seen(band)
        if batch in seen:
            return seen[batch]
        if not seen:
            return self._calibrated_verify(batch)
        calibrated = self._calibrated_verify
        below = max((b for b in seen if b < batch), default=None)
        above = min((b for b in seen if b > batch), default=None)
        if below is None or above is None:  # beyond the sizes seen: the nearest one's ratio
            near = above if below is None else below
            return calibrated(batch) * seen[near] / max(calibrated(near), 1e-9)
        # Between two sizes seen, what they cost above calibration, interpolated: exact where
        # the band adds a cost linear in rows (attention at a long context).
        excess = [seen[b] - calibrated(b) for b in (below, above)]
        share = (batch - below) / (above - below)
        return calibrated(batch) + excess[0] + share * (excess[1] - excess[0])

    def _band_seen(self, band: int) -> dict[int, float]:
        """The band's measured verify times; a band with none, the nearest shorter band's (a
        sequence has just left it), else none (calibration is band 0's)."""
        for shorter in range(band, -1, -1):
            if self._verify_seen.get(shorter):
                return self._verify_seen[shorter]
        return {}

    def _calibrated_verify(self, batch: int) -> float:
        if batch <= len(self.verify_s):
            return self.verify_s[batch - 1]
        # Beyond the calibrated range: extend linearly from the last two points.
        slope = self.verify_s[-1] - self.verify_s[-2] if len(self.verify_s) > 1 else 0.0
        return self.verify_s[-1] + slope * (batch - len(self.verify_s))

    def round_seconds(
        self, draft_id: str | None, k: int, load_s: float = 0.0, context: int = 0
    ) -> float:
        if draft_id is None or k == 0:
            return self.verify(1, context)
        step = self.draft_cost(draft_id)
        return (
            self._first_seen.get(draft_id, step)
            + step * (k - 1)
            + self.draft_overhead_s.get(draft_id, 0.0)
            + self.verify(k + 1, context)
            + load_s
        )

    def rate(
        self,
        draft_id: str | None,
        alpha: float,
        k: int,
        load_s: float = 0.0,
        alpha_cont: float | None = None,
        context: int = 0,
    ) -> float:
        """Expected tokens per second of one round at `context` tokens of context."""
        if draft_id is None or k == 0:
            return 1.0 / self.verify(1, context)
        seconds = self.round_seconds(draft_id, k, load_s, context)
        return expected_tokens(alpha, k, alpha_cont) / seconds

    def best_k(
        self,
        draft_id: str,
        alpha: float,
        k_max: int,
        alpha_cont: float | None = None,
        force: bool = False,
        context: int = 0,
    ) -> tuple[int, float]:
        """The k (0 = don't draft) maximising tokens/s for this draft at acceptance alpha, at
        `context` tokens of context.

        force: at least k = 1 when k_max allows, for a draft that must be tried (bandits).
        Costs not known yet: 0 (unless forced)."""
        best_k, best_rate = 0, self.rate(None, alpha, 0, context=context)
        for k in range(1, k_max + 1 if self.known else 1):
            r = self.rate(draft_id, alpha, k, alpha_cont=alpha_cont, context=context)
            if r > best_rate:
                best_k, best_rate = k, r
        if force and best_k == 0 and k_max > 0:
            return 1, self.rate(draft_id, alpha, 1, alpha_cont=alpha_cont, context=context)
        return best_k, best_rate


@dataclass
class BatchOption:
    """One sequence's round as the batch-level rule sees it: at most `k` tokens from
    `draft_id` (None: no draft) at acceptance α₁/α_c. `fixed`: k as asked (a fixed policy)."""

    draft_id: str | None
    k: int
    alpha: float = 0.0
    alpha_cont: float | None = None
    fixed: bool = False
    free: bool = True  # no forward pass of its own (Draft.free); else one per token, serially
    gap: int = 0  # context tokens a draft that is not free must feed first (catch-up)


# A batch drafts only where the plan beats drafting nothing by this much: a drafted token
# costs a batch far more than one sequence (another ubatch), and acceptance estimates are
# optimistic at the start of a request. Measured through the daemon on held-out prompts at 8
# streams: margin 1.1, auto 0.91x none; 1.3, 1.03x.
BATCH_MARGIN = 1.30


def pass_seconds(costs: CostModel, counts: list[int]) -> float:
    """A forward pass over per-sequence KV streams, sequence i carrying counts[i] tokens.
    llama.cpp splits such a pass into ubatches that take the same number of tokens from each
    sequence still holding some, one per distinct count, and every ubatch reads all the
    weights: [3, 1, 1, 1] is a pass of 4 tokens, then one of 2 (measured on this box: 102 ms
    against 63 ms for [1, 1, 1, 1] and 110 ms for [3, 3, 3, 3])."""
    cs = sorted(c for c in counts if c > 0)
    total, prev = 0.0, 0
    for i, c in enumerate(cs):
        if c > prev:
            total += costs.batch((c - prev) * (len(cs) - i))
            prev = c
    return total


def plan_batch(options: list[BatchOption], costs: CostModel, fed: list[int] = ()) -> list[int]:
    """The decision rule for a batch of sequences: k per sequence maximising the expected
    tokens of the whole batch per second of its round,

        Σ tokens_per_round(α_i, k_i) / (pass_seconds(k_i + 1, fed) + Σ draft_cost_i(k_i)),

    one verification pass shared by every sequence (with the prompt chunks `fed` of joining
    sequences in it: they add to the pass but yield nothing). A pass costs one ubatch per
    distinct token count (pass_seconds), so uneven ks are dear: the plans tried give every
    drafting sequence the same depth d (capped by its own proposal), drafting only the
    sequences at or above an acceptance threshold; d = 0, drafting nothing, is one of them,
    and a plan that drafts must beat it by BATCH_MARGIN. As the batch grows a drafted
    token's share of the pass rises and speculation shrinks by itself. Drafts that are not
    free (model drafts, heads: forward passes of their own) stall every sequence while they
    draft (and catch up on the context): the plans are made with and without them.
    Fixed choices (a request's own k) are kept as asked.
    """

    def drafting_s(o: BatchOption, k: int) -> float:
        """What drafting k tokens costs a sequence this round, serially: its steps (a draft
        that is not free), the draft's per-round overhead and, for a draft behind the
        context, its catch-up (every sequence waits)."""
        if o.draft_id is None or k == 0:
            return 0.0
        catchup = costs.catchup_s(o.draft_id) * o.gap if not o.free and o.gap > 2 else 0.0
        first = costs.draft_overhead_s.get(o.draft_id, 0.0) + catchup
        return (0.0 if o.free else costs.draft_cost(o.draft_id) * k) + first

    # Per option and k (0..its cap): the expected tokens, and what drafting k costs serially.
    expect = [[expected_tokens(o.alpha, k, o.alpha_cont) for k in range(o.k + 1)] for o in options]
    drafting = [[drafting_s(o, k) for k in range(o.k + 1)] for o in options]

    def rate(ks: list[int]) -> float:
        tokens = sum(e[k] for e, k in zip(expect, ks, strict=True))
        seconds = pass_seconds(costs, [k + 1 for k in ks] + list(fed))
        seconds += sum(c[k] for c, k in zip(drafting, ks, strict=True))
        return tokens / seconds if seconds > 0 else 0.0

    fixed = [o.k if o.fixed else 0 for o in options]
    if not costs.known:  # nothing measured yet: only what was asked for drafts
        return fixed
    best, best_rate = fixed, rate(fixed) * BATCH_MARGIN
    depth = max((o.k for o in options if not o.fixed), default=0)
    for allow_passes in (False, True):
        usable = [
            i
            for i, o in enumerate(options)
            if not o.fixed and o.draft_id is not None and o.k > 0 and (allow_passes or o.free)
        ]
        if allow_passes and all(options[i].free for i in usable):
            break
        thresholds = sorted({options[i].alpha for i in usable}, reverse=True)
        for threshold in thresholds:
            chosen = [i for i in usable if options[i].alpha >= threshold]
            for d in range(1, depth + 1):
                ks = list(fixed)
                for i in chosen:
                    ks[i] = min(d, options[i].k)
                r = rate(ks)
                if r > best_rate:
                    best, best_rate = ks, r
    return best


def best_choice(options: Iterable[tuple[D, int, float]], plain_rate: float) -> tuple[D | None, int]:
    """Among (draft, its best k, rate) options, the draft whose round beats plain decoding by
    the most; (None, 0) when none does. Ties keep the earlier option."""
    best: tuple[D | None, int] = (None, 0)
    best_rate = plain_rate
    for draft, k, rate in options:
        if k > 0 and rate > best_rate:
            best, best_rate = (draft, k), rate
    return best


def match_prior(m: int) -> float:
    """α of a lookup's proposal after a match of m tokens, before any round of its key is
    seen: m / (m + 2), within 0.1 of the context matches measured for m ≤ 8 (datastore
    DEFAULT_ALPHA) and near 1 for a copy that has run 200 tokens, so the rule drafts it deep
    from its first round (memspec.drafts.prompt_lookup)."""
    return m / (m + 2) if m > 0 else 0.0


class AcceptanceEstimator:
    """Running acceptance per statistic key (a draft, or a draft in a state): α₁ of a round's
    first drafted token and α_c of each later one given the one before was accepted.

    Each verified round adds its comparisons: the first token, accepted or not; then, if it
    was, the accepted continuation and, if the round stopped on a rejection, one rejected. A
    Beta prior keeps unseen keys at a sane value; the counts decay so the estimates follow the
    current context rather than the whole history.
    """

    COUNTS = ("acc", "seen", "cont_acc", "cont_seen")  # the tables counts() saves, as _<name>

    def __init__(self, prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.95):
        self.prior_alpha, self.prior_weight, self.decay = prior_alpha, prior_weight, decay
        self._acc: dict[str, float] = {}
        self._seen: dict[str, float] = {}
        self._cont_acc: dict[str, float] = {}
        self._cont_seen: dict[str, float] = {}
        self._priors: dict[str, float] = {}

    def set_prior(self, key: str, alpha: float) -> None:
        self._priors[key] = alpha

    def seed_prior(self, key: str, alpha: float) -> None:
        """A prior for `key` unless it has one (a predictor's round priors come first)."""
        self._priors.setdefault(key, alpha)

    def _prior(self, key: str) -> float:
        # "draft/state" keys fall back to the draft's prior.
        return self._priors.get(key, self._priors.get(key.split("/")[0], self.prior_alpha))

    def alpha(self, key: str) -> float:
        """α₁: acceptance of a round's first drafted token."""
        acc = self._acc.get(key, 0.0) + self._prior(key) * self.prior_weight
        seen = self._seen.get(key, 0.0) + self.prior_weight
        return min(acc / seen, 0.995)

    def alpha_cont(self, key: str) -> float:
        """α_c: acceptance of a later drafted token, given the one before it was accepted."""
        acc = self._cont_acc.get(key, 0.0) + self._prior(key) * self.prior_weight
        seen = self._cont_seen.get(key, 0.0) + self.prior_weight
        return min(acc / seen, 0.995)

    def update(self, key: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        d = self.decay
        self._acc[key] = self._acc.get(key, 0.0) * d + (1.0 if accepted > 0 else 0.0)
        self._seen[key] = self._seen.get(key, 0.0) * d + 1.0
        if accepted > 0 and proposed > 1:
            compared = (accepted - 1) + (1 if accepted < proposed else 0)
            if compared:
                self._cont_acc[key] = self._cont_acc.get(key, 0.0) * d + (accepted - 1)
                self._cont_seen[key] = self._cont_seen.get(key, 0.0) * d + compared

    def snapshot(self) -> dict[str, float]:
        """α₁ per key seen, rounded (what a restart must carry over)."""
        return {key: round(self.alpha(key), 4) for key in sorted(self._seen)}

    def counts(self) -> dict[str, dict[str, float]]:
        """The decayed counts behind the estimates (priors are the runtime's, not saved)."""
        return {name: dict(getattr(self, "_" + name)) for name in self.COUNTS}

    def restore(self, counts: dict[str, dict[str, float]], keep: Callable[[str], bool]) -> int:
        """Take saved counts for the keys `keep` accepts; returns how many keys were taken."""
        taken = set()
        for name in self.COUNTS:
            table: dict[str, float] = getattr(self, "_" + name)
            for key, value in counts.get(name, {}).items():
                if keep(key) and isinstance(value, int | float) and 0 <= value < 1e6:
                    table[key] = float(value)
                    taken.add(key)
        return len(taken)
