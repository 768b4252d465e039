"""Traces: what every draft of the pool does on a workload, measured on the real models.

One JSONL file: a header line (machine, settings, measured costs, draft sizes and real load
times), then one line per request with
- the prompt and the target's greedy output (the reference every policy must reproduce),
- per draft and per output position i, what the draft would propose from context
  prompt + output[:i] (at most k_max tokens) and how many of those the target accepts
  (`length`, `run`). For a greedy model draft this is read off one teacher-forced pass: the draft
  agrees with the target until the first mismatch, so the accepted run from i is the number of
  consecutive positions from i where the draft's argmax equals the target's token. Other kinds
  (prompt lookup, ...) are asked to propose at every position. This makes replay exact for any
  (draft, k) sequence a policy picks, not only the ones that were run;
- measured runs (plain decoding and each draft at a fixed k), round by round: draft, k,
  proposed, accepted, draft and verify seconds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from memspec.backends.base import common_prefix
from memspec.drafts.model import ModelDraft
from memspec.engine.costs import RoundCosts
from memspec.engine.policy import Choice, FixedPolicy, RoundPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import speculative_generate
from memspec.engine.types import Draft
from memspec_lab.sim.workload import RequestSpec

TRACE_VERSION = 1


@dataclass
class DraftPositions:
    """Per output position: proposal length (≤ k_max), accepted prefix, statistic key."""

    length: list[int]
    run: list[int]
    keys: list[str] | None = None  # key suffix per position ("n3"); None: the draft's id


@dataclass
class RoundRecord:
    draft: str | None
    k: int
    proposed: int
    accepted: int
    draft_s: float
    verify_s: float


@dataclass
class RunRecord:
    draft: str | None
    k: int
    seconds: float
    prefill_s: float
    tokens: int
    identical: bool
    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TraceRequest:
    id: str
    question_id: int
    category: str
    turn: int
    prompt: list[int]
    output: list[int]
    drafts: dict[str, DraftPositions]
    plain: RunRecord
    runs: dict[str, RunRecord] = field(default_factory=dict)
    text: str = ""  # the last user message (predictor cues)
    # Measured while collecting: prefill seconds per token of the target and each model draft.
    timing: dict[str, float] = field(default_factory=dict)


@dataclass
class Trace:
    header: dict
    requests: list[TraceRequest]

    @property
    def draft_ids(self) -> list[str]:
        return list(self.header["drafts"])

    def by_id(self) -> dict[str, TraceRequest]:
        return {r.id: r for r in self.requests}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps({"type": "header", **self.header}) + "\n")
            for r in self.requests:
                f.write(encode_request(r) + "\n")


def encode_request(r: TraceRequest) -> str:
    return json.dumps({"type": "request", **asdict(r)}, separators=(",", ":"))


def _run_from(d: dict) -> RunRecord:
    rounds = [RoundRecord(**x) for x in d.pop("rounds", [])]
    return RunRecord(**d, rounds=rounds)


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; a clear error names the file and line on anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path} (run `memspec traces collect`)")
    header: dict | None = None
    requests: list[TraceRequest] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                kind = d.pop("type")
                if kind == "header":
                    if d.get("version") != TRACE_VERSION:
                        raise ValueError(f"trace version {d.get('version')} != {TRACE_VERSION}")
                    header = d
                elif kind == "request":
                    d["drafts"] = {k: DraftPositions(**v) for k, v in d["drafts"].items()}
                    d["plain"] = _run_from(d["plain"])
                    d["runs"] = {k: _run_from(v) for k, v in d["runs"].items()}
                    requests.append(TraceRequest(**d))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: malformed trace line: {e}") from e
    if header is None:
        raise ValueError(f"{path}: no header line")
    return Trace(header, requests)


# --- collection ---------------------------------------------------------------------------


class RecordingPolicy:
    """Wraps a round policy and records each round's draft/verify time and outcome.

    A round runs from one choose() to the next: `draft_s` is the time spent choosing and
    proposing, the rest of the round (verification, acceptance, emission) is `verify_s`.
    """

    def __init__(self, inner: RoundPolicy):
        self.inner = inner
        self.rounds: list[RoundRecord] = []
        self.first_choose: float | None = None
        self._open: tuple[float, RoundRecord] | None = None  # (its start, the round so far)

    def choose(self, context, k_room, params, rng) -> Choice:
        t = time.perf_counter()
        self._close(t)
        if self.first_choose is None:
            self.first_choose = t
        c = self.inner.choose(context, k_room, params, rng)
        if c.draft is not None and c.k > 0 and c.proposal is None:
            c.proposal = c.draft.propose(context, c.k, params, rng)
        draft = c.draft.id if c.draft is not None else None
        self._open = (t, RoundRecord(draft, c.k, 0, 0, time.perf_counter() - t, 0.0))
        return c

    def observe(self, key, proposed, accepted, seconds) -> None:
        if self._open is not None:
            self._open[1].proposed, self._open[1].accepted = proposed, accepted
        self.inner.observe(key, proposed, accepted, seconds)

    def observe_costs(self, measured: RoundCosts) -> None:
        self.inner.observe_costs(measured)

    def _close(self, t: float) -> None:
        if self._open is None:
            return
        (t0, record), self._open = self._open, None
        record.verify_s = max(0.0, t - t0 - record.draft_s)
        self.rounds.append(record)

    def finish(self) -> None:
        self._close(time.perf_counter())


def teacher_forced_runs(
    draft: ModelDraft, prompt: list[int], output: list[int], k_max: int, timing: dict | None = None
):
    """Accepted run from each output position, teacher-forced one token at a time: the way the
    live draft runs. Not one batch: a draft's kernels may depend on the batch shape (Q2_K's do
    from 8 tokens on, by up to 1.9 in a logit), and a flipped near-tie would make the replay
    differ from what the live draft proposes."""
    n = len(output)
    if n == 0:
        return DraftPositions([], [])
    be = draft.backend
    be.reset()
    if len(prompt) > 1:
        t = time.perf_counter()
        be.eval(prompt[:-1], all_logits=False)
        if timing is not None:
            timing[f"prefill_s_per_token/{draft.id}"] = (time.perf_counter() - t) / (
                len(prompt) - 1
            )
    if (donor := draft.kv_donor) is not None:
        # Live, the draft's first round copies the target's prompt cache: start from that.
        be.reset()
        if common_prefix(donor.tokens, prompt[:-1]) < len(prompt) - 1:
            donor.reset()
            donor.eval(prompt[:-1], all_logits=False)
        t = time.perf_counter()
        kept = draft.cached_prefix(prompt)
        if kept and timing is not None:
            timing[f"kv_copy_s/{draft.id}"] = time.perf_counter() - t
        if kept < len(prompt) - 1:
            be.eval(prompt[kept:-1], all_logits=False)
    logits = np.concatenate([be.eval([t]) for t in [prompt[-1], *output[:-1]]])
    be.reset()
    top = np.argmax(logits, axis=1)
    match = top == np.asarray(output)
    run = [0] * n
    streak = 0
    for i in range(n - 1, -1, -1):  # consecutive matches from i onward
        streak = streak + 1 if match[i] else 0
        run[i] = min(streak, k_max)
    # A draft that stops early when unsure (ModelDraft.min_confidence) proposes fewer tokens:
    # it keeps the first unsure token after the first and stops there. Confidence is read off
    # the teacher-forced pass: exact up to the first rejection, which is all acceptance needs.
    min_conf = getattr(draft, "min_confidence", 0.0) or 0.0
    z = logits - logits.max(axis=1, keepdims=True)
    conf = 1.0 / np.exp(z).sum(axis=1)  # softmax probability of the argmax
    length = []
    for i in range(n):
        n_prop = min(k_max, n - i)
        for t in range(1, n_prop):
            if conf[i + t] < min_conf:
                n_prop = t + 1
                break
        length.append(n_prop)
    return DraftPositions(length, run)


def proposed_runs(draft: Draft, prompt: list[int], output: list[int], k_max: int):
    """Ask the draft at every position (cheap kinds: prompt lookup, suffix caches...)."""
    params, rng = SamplingParams(), np.random.default_rng(0)
    length, run, keys = [], [], []
    for i in range(len(output)):
        p = draft.propose(prompt + output[:i], k_max, params, rng)
        toks = p.tokens[:k_max]
        a = 0
        while a < len(toks) and i + a < len(output) and toks[a] == output[i + a]:
            a += 1
        length.append(len(toks))
        run.append(a)
        keys.append(p.key.split("/", 1)[1] if "/" in p.key else "")
    return DraftPositions(length, run, keys if any(keys) else None)


def built_pool(manifest_dir: Path | None = None) -> list[str]:
    """Ids of the pool's drafts whose files exist (a manifest may describe an unbuilt draft)."""
    from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
    from memspec.paths import models_dir

    out = []
    for m in load_manifests(manifest_dir or DEFAULT_MANIFEST_DIR).values():
        if m.file is None or m.model_path(models_dir()).is_file():
            out.append(m.id)
    return out


def footprints(rt, draft_ids: list[str]) -> tuple[int, dict[str, int]]:
    """Modelled resident bytes (SpecMemo footprint model) of the target and of each draft."""
    from memspec.memory.footprint import draft_footprint, target_footprint
    from memspec.paths import models_dir

    s = rt.settings
    target = target_footprint(
        rt.target.path, s.n_ctx, s.k_max, s.n_gpu_layers, kv_cache=s.kv_cache
    ).total
    sizes = {}
    for d in draft_ids:
        m = rt.draft_admin.manifest(d)
        path = m.model_path(models_dir()) if m.file else None
        sizes[d] = draft_footprint(
            m.kind, path, s.n_ctx, m.params, s.n_gpu_layers, s.draft_kv_cache
        ).total
    return target, sizes


def measure_loads(rt, draft_ids: list[str], reps: int) -> dict[str, list[float]]:
    """Seconds for real loads (into process memory, mmap off) of each model draft: private
    copies, never joining the weights the runtime holds already (backends.shared_weights)."""
    from memspec.drafts.registry import instantiate

    options = replace(rt.options, share_weights=False)
    out: dict[str, list[float]] = {}
    for d in draft_ids:
        m = rt.draft_admin.manifest(d)
        times = []
        for _ in range(reps if m.kind == "model" else 1):
            t = time.perf_counter()
            draft = instantiate(m, options, rt.settings.backend, target_backend=rt.target)
            times.append(time.perf_counter() - t)
            draft.close()
        out[d] = times
    return out


def _run(rt, prompt: list[int], params: SamplingParams, policy: RoundPolicy, ref=None):
    for d in rt.drafts.values():  # every run starts cold: no KV reuse across runs
        if isinstance(d, ModelDraft):
            d.backend.reset()
    rt.target.reset()
    rec = RecordingPolicy(policy)
    t = time.perf_counter()
    with rt.lock:
        gen = speculative_generate(rt.target, prompt, params, rec)
    rec.finish()
    draft_id = getattr(policy, "draft", None)
    run = RunRecord(
        draft=draft_id.id if draft_id is not None else None,
        k=getattr(policy, "k", 0),
        seconds=gen.elapsed_s,
        prefill_s=(rec.first_choose or t) - t,
        tokens=gen.completion_tokens,
        identical=ref is None or gen.token_ids == ref,
        rounds=rec.rounds,
    )
    return gen, run


def collect(
    rt,
    requests: list[RequestSpec],
    out: Path,
    max_tokens: int = 96,
    k_run: int = 4,
    load_reps: int = 3,
    with_runs: bool = True,
    progress: bool = True,
) -> Trace:
    """Run plain decoding and every resident draft of `rt` on each request; write `out`."""
    from tqdm import tqdm

    k_max = rt.settings.k_max
    draft_ids = list(rt.drafts)
    header = {
        "version": TRACE_VERSION,
        "created": time.time(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "settings": {
            "target": rt.settings.target,
            "n_ctx": rt.settings.n_ctx,
            "n_threads": rt.settings.n_threads,
            "k_max": k_max,
            "max_tokens": max_tokens,
            "k_run": k_run,
        },
        "target": {
            "bytes": footprints(rt, [])[0],
            "weight_bytes": rt.target.weight_bytes(),
        },
        "drafts": {},
        "costs": {
            "verify_s": rt.costs.verify_s,
            "draft_s": rt.costs.draft_s,
            "draft_overhead_s": rt.costs.draft_overhead_s,
        },
    }
    loads = measure_loads(rt, draft_ids, load_reps)
    sizes = footprints(rt, draft_ids)[1]
    for d in draft_ids:
        draft = rt.drafts[d]
        header["drafts"][d] = {
            "kind": draft.kind,
            "bytes": sizes[d],
            "load_s": [round(x, 5) for x in loads[d]],
            "load_s_median": round(statistics.median(loads[d]), 5),
            "shares_target_kv": getattr(draft, "kv_donor", None) is not None,
        }
    params = SamplingParams(max_tokens=max_tokens)
    first_answers: dict[int, str] = {}
    trace = Trace(header, [])
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        f.write(json.dumps({"type": "header", **header}) + "\n")
        for spec in tqdm(requests, desc="traces collect", unit="req", disable=not progress):
            req = collect_one(rt, spec, params, first_answers, k_max, k_run, with_runs)
            trace.requests.append(req)
            f.write(encode_request(req) + "\n")
            f.flush()
    return trace


def chat_messages(spec: RequestSpec, first_answer: str | None) -> list[dict[str, str]]:
    if spec.turn == 1:
        return [{"role": "user", "content": spec.turns[0]}]
    return [
        {"role": "user", "content": spec.turns[0]},
        {"role": "assistant", "content": first_answer or ""},
        {"role": "user", "content": spec.turns[1]},
    ]


def collect_one(
    rt,
    spec: RequestSpec,
    params: SamplingParams,
    first_answers: dict[int, str],
    k_max: int,
    k_run: int,
    with_runs: bool,
) -> TraceRequest:
    if spec.turn == 2 and spec.question_id not in first_answers:
        first = RequestSpec(spec.question_id, spec.category, 1, spec.turns)
        p1 = rt.requests.prompt_tokens(messages=chat_messages(first, None))
        gen1, _ = _run(rt, p1, params, FixedPolicy(None, 0))
        first_answers[spec.question_id] = gen1.text
    prompt = rt.requests.prompt_tokens(
        messages=chat_messages(spec, first_answers.get(spec.question_id))
    )
    gen, plain = _run(rt, prompt, params, FixedPolicy(None, 0))
    if spec.turn == 1:
        first_answers[spec.question_id] = gen.text
    ref = gen.token_ids
    positions: dict[str, DraftPositions] = {}
    runs: dict[str, RunRecord] = {}
    timing = {"prefill_s_per_token/target": plain.prefill_s / max(len(prompt) - 1, 1)}
    for d, draft in rt.drafts.items():
        if isinstance(draft, ModelDraft):
            positions[d] = teacher_forced_runs(draft, prompt, ref, k_max, timing)
        else:
            positions[d] = proposed_runs(draft, prompt, ref, k_max)
        if with_runs:
            _, runs[d] = _run(rt, prompt, params, FixedPolicy(draft, k_run), ref)
    return TraceRequest(
        id=spec.id,
        question_id=spec.question_id,
        category=spec.category,
        turn=spec.turn,
        prompt=prompt,
        output=ref,
        drafts=positions,
        plain=plain,
        runs=runs,
        text=spec.turns[spec.turn - 1],
        timing={k: round(v, 7) for k, v in timing.items()},
    )
