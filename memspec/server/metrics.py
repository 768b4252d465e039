"""Prometheus metrics, all prefixed `memspec_`, in a registry of their own (one per app).

Counters move with traffic; gauges (budget, memory, queue, resident drafts, prefix cache) are
read when scraped. Draft loads and evictions are counted from residency changes, whoever made
them (admin API, scheduler, start-up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from memspec.engine.speculative import Generation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


@dataclass
class LiveValues:
    """What the gauges report, read at scrape time."""

    budget_bytes: int = 0
    queue_depth: int = 0
    active_slots: int = 0
    slots: int = 1
    prefix_cache_bytes: int = 0
    drafts: list[dict] = field(default_factory=list)  # DraftAdmin.draft_status() rows


class _LiveCollector(Collector):
    def __init__(self, metrics: Metrics, read: Callable[[], LiveValues]):
        self._metrics = metrics
        self._read = read
        self._proc = psutil.Process()

    def collect(self) -> Iterable[Metric]:
        v = self._read()
        self._metrics.observe_residency(v.drafts)
        yield GaugeMetricFamily(
            "memspec_budget_bytes", "Memory budget for models, KV caches and drafts", v.budget_bytes
        )
        yield GaugeMetricFamily(
            "memspec_process_memory_bytes",
            "Resident set size of the daemon process",
            self._proc.memory_info().rss,
        )
        yield GaugeMetricFamily(
            "memspec_queue_depth", "Requests waiting for the engine", v.queue_depth
        )
        yield GaugeMetricFamily(
            "memspec_active_slots", "Sequences being decoded now (batched)", v.active_slots
        )
        yield GaugeMetricFamily(
            "memspec_slots", "Sequence slots the engine decodes together", v.slots
        )
        yield GaugeMetricFamily(
            "memspec_prefix_cache_bytes",
            "Bytes of KV snapshots held for multi-session reuse",
            v.prefix_cache_bytes,
        )
        resident = GaugeMetricFamily(
            "memspec_draft_resident_bytes",
            "Bytes of each resident draft (0 for zero-weight drafts such as prompt lookup)",
            labels=["draft"],
        )
        value = GaugeMetricFamily(
            "memspec_draft_predicted_value",
            "What the policy's last plan predicts holding each draft is worth (it prefetches "
            "and evicts by this; 0: not wanted now)",
            labels=["draft"],
        )
        for row in v.drafts:
            if row.get("resident"):
                resident.add_metric([str(row["id"])], float(row.get("bytes") or 0))
            if row.get("compatible", True):
                value.add_metric([str(row["id"])], float(row.get("value") or 0.0))
        yield resident
        yield value


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "memspec_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.tokens = Counter("memspec_tokens_generated", "Completion tokens sent", registry=r)
        self.prompt_tokens = Counter("memspec_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "memspec_cached_prompt_tokens", "Prompt tokens whose KV was reused", registry=r
        )
        self.proposed = Counter(
            "memspec_draft_proposed", "Tokens proposed, per draft", ["draft"], registry=r
        )
        self.accepted = Counter(
            "memspec_draft_accepted", "Proposed tokens accepted, per draft", ["draft"], registry=r
        )
        self.rounds = Counter("memspec_rounds", "Decode rounds (draft + verify)", registry=r)
        self.batch_tokens = Histogram(
            "memspec_batch_tokens",
            "Tokens in each forward pass of the target (every sequence of a batched round)",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_sequences = Histogram(
            "memspec_batch_sequences",
            "Sequences in each forward pass of the target",
            buckets=SEQ_BUCKETS,
            registry=r,
        )
        self.loads = Counter("memspec_draft_loads", "Drafts made resident", registry=r)
        self.evictions = Counter("memspec_draft_evictions", "Drafts evicted", registry=r)
        self.stall = Counter(
            "memspec_stall_seconds", "Seconds generation waited on draft loads", registry=r
        )
        # Several models under one budget (memspec.targets): per model.
        self.model_bytes = Gauge(
            "memspec_model_resident_bytes",
            "Bytes a model holds (target, KV, its drafts; modelled), 0 when not resident",
            ["model"],
            registry=r,
        )
        self.model_loads = Counter(
            "memspec_model_loads", "Times a model was loaded", ["model"], registry=r
        )
        self.model_evictions = Counter(
            "memspec_model_evictions",
            "Times a model was unloaded to make room for another",
            ["model"],
            registry=r,
        )
        self.model_unloads = Counter(
            "memspec_model_unloads",
            "Times a model was unloaded, by why (evict, expire: keep_alive ran out, unload)",
            ["model", "why"],
            registry=r,
        )
        self.model_loads_wasted = Counter(
            "memspec_model_loads_wasted",
            "Loads of a model evicted before it served a request (a switch that did not pay)",
            ["model"],
            registry=r,
        )
        self.model_loads_abandoned = Counter(
            "memspec_model_loads_abandoned",
            "Loads stopped part way because every request waiting for the model had gone",
            ["model"],
            registry=r,
        )
        self.model_stall = Counter(
            "memspec_model_stall_seconds",
            "Request-seconds spent waiting on a model's load (the requests waiting for it and "
            "those paused in flight, times the load's seconds)",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "memspec_time_to_first_token_seconds",
            "Arrival to first token (queue wait + prefill + first round)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.token_latency = Histogram(
            "memspec_token_latency_seconds",
            "Mean seconds per output token after the first, one observation per request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self._resident: set[str] | None = None
        self._lock = threading.Lock()

    def attach(self, read: Callable[[], LiveValues]) -> None:
        self.registry.register(_LiveCollector(self, read))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_residency(self, rows: list[dict]) -> None:
        """Count loads/evictions as changes of the resident set (start-up loads count too)."""
        if not rows:
            return
        now = {str(r["id"]) for r in rows if r.get("resident")}
        with self._lock:
            before = self._resident if self._resident is not None else set()
            self._resident = now
        if now - before:
            self.loads.inc(len(now - before))
        if before - now:
            self.evictions.inc(len(before - now))

    def observe_model_load(self, model: str, seconds: float, stalled_requests: int) -> None:
        """A model loaded in `seconds` while `stalled_requests` requests waited for it."""
        self.model_stall.labels(model).inc(seconds * max(1, stalled_requests))

    def observe_model_change(self, model: str, what: str) -> None:
        """A model loaded ("load") or unloaded ("evict", "expire", "unload"), an eviction of
        a load that served nothing ("wasted"), or a load stopped part way ("abandoned")."""
        if what == "load":
            self.model_loads.labels(model).inc()
            return
        if what == "wasted":
            self.model_loads_wasted.labels(model).inc()
            return
        if what == "abandoned":
            self.model_loads_abandoned.labels(model).inc()
            return
        self.model_unloads.labels(model, what).inc()
        if what == "evict":
            self.model_evictions.labels(model).inc()

    def observe_models(self, rows: list[dict]) -> None:
        """Every servable model's resident bytes (memspec.targets.Targets.status rows)."""
        for row in rows:
            self.model_bytes.labels(row["name"]).set(row["bytes"])

    def observe_round(self, sequences: int, tokens: int) -> None:
        """One forward pass of the engine: how many sequences and tokens it carried."""
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(tokens)

    def observe_generation(
        self, gen: Generation, per_draft: dict[str, tuple[int, int]], queued_s: float
    ) -> None:
        """One finished generation; per_draft: draft id -> (proposed, accepted)."""
        self.tokens.inc(gen.completion_tokens)
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.cached_tokens.inc(gen.cached_tokens)
        self.rounds.inc(gen.rounds)
        if gen.stall_s > 0:
            self.stall.inc(gen.stall_s)
        for draft_id, (proposed, accepted) in per_draft.items():
            if proposed:
                self.proposed.labels(draft_id).inc(proposed)
                self.accepted.labels(draft_id).inc(accepted)
        if gen.completion_tokens:
            self.ttft.observe(queued_s + gen.ttft_s)
        if gen.completion_tokens > 1:
            self.token_latency.observe(
                max(gen.elapsed_s - gen.ttft_s, 0.0) / (gen.completion_tokens - 1)
            )
