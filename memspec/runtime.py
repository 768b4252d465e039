"""The composition root: a target, its drafts, measured costs and the scheduler, from settings.

Drafts live in a WorkingSet (memspec.scheduler.working_set): resident under the memory budget
(target + its KV and buffers, charged first, then drafts), loaded and evicted by one background
thread. The working set is the budget's one holder: settings.budget sizes the start, and
`set_budget` (a live tune) changes it there. The Scheduler (memspec.scheduler.rounds) decides
every round over it: every round of the lead slot (LEAD_SLOT), and the free-draft rule of the
slots beside it. A client's request is checked once, by `request()`, into a GenerationRequest
whose fields `generate()` decodes (tools that hold token ids call `generate()` directly).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.backends.embedding import LlamaEmbedder, plan_embedding
from memspec.config import Settings
from memspec.drafts.compat import check_draft, fingerprint_of, incompatible_error
from memspec.drafts.datastore import DatastoreDraft
from memspec.drafts.family import settings_pool_dir, skipped_error, skipped_recipes
from memspec.drafts.manifest import DraftManifest, check_id, load_manifests
from memspec.drafts.registry import draft_kind
from memspec.engine.calibration import Calibration, measure_draft_cached
from memspec.engine.context_shift import Shifted, shift_messages
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.fim import FimRequest, FimTokens, fim_prompt, find_fim_tokens
from memspec.engine.grammar import Grammar
from memspec.engine.prefix_cache import PrefixCache, share_slot_prefix
from memspec.engine.slots import SlotTable
from memspec.engine.speculative import (
    Generation,
    Sequence,
    TokenCallback,
    check_prompt,
    decode_round,
)
from memspec.engine.types import Draft, ModelBacked, RoundPolicy, SamplingParams
from memspec.errors import (
    BudgetExceeded,
    InvalidRequest,
    LoadAbandoned,
    MemSpecError,
    ModelLoadError,
    UnknownDraft,
)
from memspec.memory.footprint import (
    Footprint,
    embedding_footprint,
    split_footprint,
    target_footprint,
)
from memspec.memory.gguf_info import read_shape
from memspec.memory.plan import MIN_N_CTX, ContextPlan, DraftFit, draft_fits, fit_hint, plan_context
from memspec.model_id import model_aliases, served_model_id
from memspec.paths import data_dir, models_dir, resolve_model_path
from memspec.predictor.artifacts import predictor_path
from memspec.predictor.model import load_or_fallback
from memspec.rpc.endpoints import LayerSplit, layer_split
from memspec.scheduler.draft_choice import AUTO_ASK, DraftAsk
from memspec.scheduler.learned import Memory
from memspec.scheduler.manifest_source import ManifestSource
from memspec.scheduler.rounds import LEAD_SLOT, Scheduler
from memspec.scheduler.working_set import WorkingSet
from memspec.units import format_size

log = logging.getLogger(__name__)


@dataclass
class ClientRequest:
    """A generation as a client asks for it, before it is checked against the runtime."""

    prompt: str | list[int] | None = None  # text, or token ids (completions)
    messages: list[dict[str, str]] | None = None  # chat
    max_tokens: int | None = None  # None: settings.default_max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    draft: str = "auto"  # "auto", "none" or a draft id
    policy: str | None = None  # for draft "auto"; None: settings.policy
    cache_partition: str = ""  # whose cached prefixes it may reuse (key and cache_salt)
    # Sampling fields beyond temperature/top_p (None: SamplingParams' default, i.e. off).
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False  # llama-server's: end-of-generation tokens banned
    logprobs: int | None = None  # report logprobs with this many alternatives; None: off
    fim: FimRequest | None = None  # fill-in-the-middle: the prompt is built from it
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: end the text like EOS
    grammar: str | None = None  # GBNF the output must follow (engine/grammar.py)
    grammar_param: str = "grammar"  # the request field the grammar came from (its 400s)
    tools: list[dict[str, Any]] | None = None  # chat: the tools the chat template receives
    context_overflow: str | None = None  # chat: "error" or "shift"; None: the setting's
    model: str = ""  # the served name of the model that runs it ("": the default target)
    # How long the model stays loaded after this request (Ollama's keep_alive), in seconds;
    # None: settings.keep_alive; negative: no expiry; 0: unloaded once it is idle.
    keep_alive_s: float | None = None


# ClientRequest's sampling fields that map one to one onto SamplingParams.
SAMPLING_FIELDS = (
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class GenerationRequest:
    """A generation this runtime can run as it is (Runtime.request checks a ClientRequest)."""

    prompt: list[int]
    params: SamplingParams
    draft: DraftAsk = AUTO_ASK  # parsed and checked once (Runtime.draft_ask)
    policy: str | None = None  # None: settings.policy
    messages: list[dict[str, str]] | None = None  # chat: what the scheduler's predictor reads
    cache_partition: str = ""  # whose cached prefixes it may reuse (PrefixCache)
    # A chat shifted to fit the context: {"dropped_messages": n, "dropped_tokens": m}.
    context_shift: dict[str, int] | None = None



# A load checks between its stages (target, drafts, calibration) whether anyone still waits
# for it: the engine thread sets the check while it loads a model for waiting requests.
_load_check = threading.local()


@contextlib.contextmanager
def abandon_when(gone: Callable[[], bool]) -> Iterator[None]:
    """Runtimes built on this thread inside the block stop with LoadAbandoned (closing what
    they loaded) at their next stage once `gone()` is true."""
    _load_check.gone = gone
    try:
        yield
    finally:
        _load_check.gone = None


@contextlib.contextmanager
def drafts_join_later() -> Iterator[None]:
    """Runtimes built on this thread inside the block (a model loaded for requests that wait
    for it) load at once only the drafts that take no memory, plus any whose cost this process
    has not measured yet; the others join when the policy's plan says they pay (its replan at a
    request's start and end loads them on the working set's thread): a switch back to a model
    costs its target's load, not its whole family's."""
    _load_check.drafts_later = True
    try:
        yield
    finally:
        _load_check.drafts_later = False


# Draft costs measured in this process, by (target file, draft id): a model loaded again
# (drafts_join_later) prices the drafts it leaves for later with them.
_draft_costs: dict[tuple[str, str], tuple[float | None, float | None]] = {}


def _stage(what: str) -> None:
    gone = getattr(_load_check, "gone", None)
    if gone is not None and gone():
        raise LoadAbandoned(f"load stopped before {what}: every request for the model has gone")


class Runtime:
    def __init__(
        self,
        settings: Settings,
        calibrate_costs: bool = True,
        batched: bool = False,
        target: Backend | None = None,
        defer_calibration: bool = False,
    ):
        """`calibrate_costs`: measure this device's costs (or read them from the cache);
        False: every cost alike (CostModel.alike). `defer_calibration`: a calibration the
        caches do not hold is not measured now: the target serves at once, plain (its costs
        unknown), and calibrate_pending() measures while no request runs (the daemon: a new
        model's first token does not wait for it). `batched`: give the target the sequence
        slots settings.parallel asks for (the daemon); tools that decode one sequence at a
        time get one. `target`: a backend to decode with instead of loading settings.target
        (whose file still sizes the budget and checks the drafts' tokenizer): `memspec bench
        runtime` times the runtime's own cost per token over a stub whose step costs
        nothing. The runtime closes it."""
        self.settings = settings
        pool = settings_pool_dir(settings)
        self.manifest_errors: dict[str, str] = {}  # manifests left out (file stem -> why)
        self.preload_errors: dict[str, str] = {}  # drafts named at start but left out (id -> why)
        self.manifests: dict[str, DraftManifest] = load_manifests(pool, self.manifest_errors)
        for name, why in self.manifest_errors.items():
            log.error("draft manifest %s left out: %s", name, why)
        # What is loaded at start: settings.drafts, else the whole family as far as it is built.
        self.preload_ids = (
            list(settings.drafts) if settings.drafts is not None else self._whole_family()
        )
        target_path = resolve_model_path(settings.target)
        self._target_file = str(target_path)  # the key of its drafts' costs (_draft_costs)
        # Every manifest is checked against the target's tokenizer once: the drafts that
        # speak another are left out of the pool (draft_status says why).
        self.target_tokenizer = fingerprint_of(target_path)
        # The runtime's settings carry the resolved n_ctx.
        self.context: ContextPlan = self._plan_slots(settings, target_path, batched)
        self.slots = self.context.slots
        if settings.n_ctx == "auto":
            log.info("n_ctx auto: %s", self.context.describe())
            n_ctx = self.context.n_ctx or MIN_N_CTX  # 0: refused below, with the numbers
            settings = self.settings = settings.model_copy(update={"n_ctx": n_ctx})
        # A target split over RPC workers: how many of its layers each device holds.
        self.layer_split: LayerSplit | None = None
        rpc: dict[str, object] = {}
        if settings.rpc:
            n_units = read_shape(target_path).n_layers + 1  # llama.cpp counts the output layer
            self.layer_split = layer_split(n_units, settings.rpc, settings.tensor_split)
            rpc = {
                "rpc": tuple(settings.rpc),
                "tensor_split": tuple(float(n) for n in self.layer_split.remote),
                "rpc_timeout_s": settings.rpc_timeout_s,
            }
        self.options = BackendOptions(
            n_ctx=settings.n_ctx,
            n_threads=settings.n_threads,
            n_gpu_layers=self.layer_split.n_remote if self.layer_split else settings.n_gpu_layers,
            device=settings.device,
            chat_template=settings.chat_template,
            n_seq=self.slots,
            # Repacked CPU weights, kept bit-exact by the row rule (backends/llama_cpp.py)
            # unless exactness is numeric; not over RPC, whose workers load their layers.
            weight_repack=settings.weight_repack and not settings.rpc,
            batch_invariant=settings.exactness == "bitwise",
            kv_cache=settings.kv_cache,
            **rpc,  # type: ignore[arg-type]
        )
        # Recipes a target's family skipped (e.g. a Q4 self-draft of a Q4 target): named in
        # settings.drafts they are passed over with the reason, named in a request refused.
        self.skipped_drafts: dict[str, str] = skipped_recipes(pool)
        self.costs = CostModel.alike(settings.k_max)  # calibrated ones are adopted in place
        self._calibration: Calibration | None = None  # one left for calibrate_pending()
        self._calibrated = False
        self.calibration_error: str | None = None
        self._later: list[str] = []  # drafts that join when they pay (drafts_join_later)
        self._measure_loads = False  # drafts loaded after calibration get their cost measured
        self._lead_stall0 = 0.0  # the working set's stall clock when the lead slot's began
        self.requests_per_draft: Counter[str] = Counter()
        self.estimator = self.new_estimator()
        self.lock = threading.Lock()  # one decode loop at a time owns the models
        # The embedding context (embedder()): loaded on the first embedding request.
        self._embedder: LlamaEmbedder | None = None
        self._embedder_lock = threading.Lock()
        self.embedding_footprint: Footprint | None = None
        # The target and its KV caches (one per slot) and buffers are charged first.
        self.target_footprint: Footprint = target_footprint(
            target_path,
            settings.n_ctx,
            settings.k_max,
            settings.n_gpu_layers,
            self.slots,
            settings.kv_cache,
        )
        # Split over workers: this device's budget pays its share, each worker the rest.
        self.remote_bytes: dict[str, int] = {}
        if self.layer_split is not None:
            self.target_footprint, self.remote_bytes = split_footprint(
                self.target_footprint, read_shape(target_path), self.layer_split
            )
        if self.target_footprint.total > settings.budget_bytes:
            slots = f" and {self.slots} parallel slots" if self.slots > 1 else ""
            hint = fit_hint(
                settings.budget_bytes, target_path, settings.k_max, settings.n_gpu_layers,
                self.slots, settings.kv_cache,
            )  # fmt: skip
            raise BudgetExceeded(
                f"budget {format_size(settings.budget_bytes)} is below what the target needs "
                f"at n_ctx {settings.n_ctx}{slots}, KV {settings.kv_cache.describe()} "
                f"({format_size(self.target_footprint.total)}); {hint}; "
                "see `memspec plan --budget SIZE`",
                param="budget",
            )
        # A head drafts from the target's features: a target with one it can use loads them.
        if any(self._usable_head(m) for m in self.manifests.values()):
            self.options = replace(self.options, features=True)
        _stage("the target")
        self.target: Backend = target or load_backend(target_path, self.options, settings.backend)
        # Which of the target's sequence slots hold a sequence (the daemon takes and releases).
        self.slot_table = SlotTable(self.target.slots, lead=LEAD_SLOT)
        # What the target is served as and how its chats are rendered, from its own metadata.
        self.model_id = served_model_id(settings.model_name, target_path)
        self.model_aliases = model_aliases(
            self.model_id, self.target.metadata.get("general.name"), target_path
        )
        try:  # resolved now: a chat_template that cannot work fails the start, not each chat
            self.chat_template = self.target.chat_template
        except Exception:
            self.target.close()
            raise
        # Drafts run here, on this device's own GPU layers (not the target's remote count).
        draft_options = replace(
            self.options, n_gpu_layers=settings.n_gpu_layers, kv_cache=settings.draft_kv_cache
        )
        self.draft_source = ManifestSource(
            self.manifests, draft_options, settings.backend, self.target_tokenizer, self.target
        )
        self.working_set: WorkingSet | None = None
        # What earlier runtimes learnt about this target (memspec.scheduler.learned).
        self.memory = Memory(self, settings.state_dir or data_dir() / "state", self.target.path)
        if settings.drafts is None:  # the default pool: what was resident last time first
            last = self.memory.resident
            self.preload_ids = last + [i for i in self.preload_ids if i not in last]
        try:
            _stage("the drafts")
            # Only the preload ids are loaded, weightless ones included: "auto" then uses
            # exactly what the configuration names until something else is loaded.
            self.working_set = WorkingSet(
                self.draft_source,
                settings.budget_bytes,
                self.target_footprint.total,
                on_loaded=self._on_draft_loaded,
                autoload_free=False,
            )
            later = self._drafts_for_later(settings, target_path)
            self._preload(self.working_set, [i for i in self.preload_ids if i not in later])
            resident = list(self.drafts.values())
            self.working_set.release_leases()
            self._later = later
            if calibrate_costs:
                _stage("calibration")
                self._calibrate(resident, defer_calibration)
            if later:
                log.info("drafts %s join later, when they pay", ", ".join(later))
            predictor = load_or_fallback(predictor_path(target_path, settings.predictor))
            if predictor.error:
                log.warning("predictor: %s; using per-kind priors", predictor.error)
            self.scheduler = Scheduler(
                self.working_set, self.costs, self.estimator, settings.k_max, predictor
            )
            self.memory.restore()
        except Exception:
            self.close()
            raise

    def _plan_slots(self, settings: Settings, target_path: Path, batched: bool) -> ContextPlan:
        """The slots (settings.parallel; 0: as many as fit the budget beside the target and
        the drafts it preloads) and the context per slot (settings.n_ctx; "auto": the longest
        that fits beside those drafts), with the trade status shows (plan_context). The torch
        backend, and tools that decode one sequence at a time (not `batched`), get one slot."""
        parallel = settings.parallel if batched and settings.backend == "llama_cpp" else 1
        if settings.backend != "llama_cpp" and settings.parallel > 1:
            log.warning(
                "parallel %d: the %s backend decodes one sequence",
                settings.parallel,
                settings.backend,
            )
        # The drafts it preloads, in order, as far as they speak the target's tokenizer.
        preload = {
            i: self.manifests[i]
            for i in self.preload_ids
            if i in self.manifests
            and check_draft(self.target_tokenizer, self.manifests[i], models_dir()) is None
        }

        def drafts_at(n_ctx: int) -> list[DraftFit]:
            return draft_fits(
                preload,
                models_dir(),
                n_ctx,
                n_gpu_layers=settings.n_gpu_layers,
                kv_cache=settings.draft_kv_cache,
            )

        return plan_context(
            settings.budget_bytes,
            target_path,
            settings.k_max,
            drafts_at,
            settings.n_ctx,
            parallel,
            settings.n_gpu_layers,
            settings.kv_cache,
        )

    def _whole_family(self) -> list[str]:
        """Every draft of the pool whose file is built: weightless ones first (they cost no
        memory), then model drafts smallest first; the budget stops the preload where it is
        full, and the policy's plan moves the rest in and out by predicted value."""
        built = [m for m in self.manifests.values() if m.is_built(models_dir())]
        weighty = [m for m in built if draft_kind(m.kind).weighty]
        size = {m.id: m.model_path(models_dir()).stat().st_size for m in weighty}
        return [m.id for m in built if m.id not in size] + sorted(size, key=size.__getitem__)

    def _usable_head(self, m: DraftManifest) -> bool:
        """A built head of this target's tokenizer, with torch there to run it."""
        return (
            draft_kind(m.kind).needs_target_features
            and m.is_built(models_dir())
            and check_draft(self.target_tokenizer, m, models_dir()) is None
            and importlib.util.find_spec("torch") is not None
        )

    @property
    def reserved_bytes(self) -> int:
        return self.target_footprint.total

    @property
    def _ws(self) -> WorkingSet:
        if self.working_set is None:
            raise RuntimeError("the runtime is closed")
        return self.working_set

    def _drafts_for_later(self, settings: Settings, target_path: Path) -> list[str]:
        """Under drafts_join_later: the preload's model drafts whose costs this process has
        measured, when the pool is the default family and the memspec policy (the one whose
        plan loads drafts) decides; else none (what settings name is loaded now)."""
        if not getattr(_load_check, "drafts_later", False):
            return []
        if settings.drafts is not None or settings.policy != "memspec":
            return []
        return [
            i
            for i in self.preload_ids
            if i in self.manifests
            and draft_kind(self.manifests[i].kind).weighty
            and (str(target_path), i) in _draft_costs
        ]

    def _preload(self, ws: WorkingSet, draft_ids: list[str]) -> None:
        """The preload ids, in order, as far as the budget allows (never evicting)."""
        for draft_id in draft_ids:
            if draft_id in self.skipped_drafts and draft_id not in self.manifests:
                log.warning("not preloading %s: %s", draft_id, self.skipped_drafts[draft_id])
                continue
            try:  # a draft refused (its manifest left out, an unknown id) is skipped, not fatal
                self.manifest(draft_id)
            except MemSpecError as e:
                log.error("draft %s left out at start: %s", draft_id, e.message)
                self.preload_errors[draft_id] = e.message
                continue
            reason = self.incompatible.get(draft_id)
            if reason is not None:
                log.warning("not preloading %s: %s", draft_id, reason)
                continue
            try:
                ws.load(draft_id, evict=False)
            except BudgetExceeded as e:
                log.warning("not preloading %s: %s", draft_id, e.message)
            except ModelLoadError as e:
                log.warning("draft %s failed to load: %s", draft_id, e.message)
                self.preload_errors[draft_id] = e.message
        ws.wait_idle(timeout=30.0)

    def _calibrate(self, resident: list[Draft], defer: bool) -> None:
        """The costs from the caches, else measured now, or (`defer`) left for
        calibrate_pending() with the rule drafting nothing till then."""
        calibration = Calibration(self.target, self.settings.k_max)
        measured = calibration.done(resident) if defer else calibration.run(resident)
        if measured is not None:
            self._land(measured)
            return
        self.costs = CostModel.unknown(self.settings.k_max)  # before the scheduler holds it
        self._calibration = calibration
        log.info("%s: not calibrated yet; decoding plain until it is (measured while idle)",
                 self.target.path.name)  # fmt: skip

    def _land(self, measured: CostModel) -> None:
        """Calibrated costs in: adopted in place (the scheduler and rounds hold self.costs),
        the drafts left for later priced as last measured (the plan can weigh them), and
        drafts loaded from now on measured as they load."""
        self.costs.adopt(measured)
        for draft_id in self._later:
            draft_s, overhead_s = _draft_costs.get((self._target_file, draft_id), (None, None))
            if draft_s is not None:
                self.costs.draft_s[draft_id] = draft_s
            if overhead_s is not None:
                self.costs.draft_overhead_s[draft_id] = overhead_s
        self._calibration, self._calibrated, self._measure_loads = None, True, True

    def calibrate_pending(self, stop: Callable[[], bool]) -> bool:
        """Engine thread, while no request runs: go on with a calibration left for later
        (defer_calibration), one timed pass at a time, until it is done or `stop()` is true
        (a request came: it waits for the pass in hand). Done, its costs replace the unknown
        ones and the drafts join as the plan finds they pay. True once none is left."""
        calibration = self._calibration
        if calibration is None or self.working_set is None:
            return True
        try:
            resident = list(self.drafts.values())
            measured = calibration.run(resident, stop, self.lock)
        except Exception as e:  # noqa: BLE001 - the model goes on serving, plain
            log.exception("%s: calibration failed; decoding plain", self.target.path.name)
            self._calibration, self.calibration_error = None, str(e)
            return True
        finally:
            self._ws.release_leases()
        if measured is None:
            return False
        self._land(measured)
        log.info("%s: calibrated (%d timed passes while idle); drafts join when they pay",
                 self.target.path.name, calibration.passes)  # fmt: skip
        return True

    @property
    def calibration(self) -> str:
        """What status shows: "calibrated", "calibrating" (left for calibrate_pending: plain
        decoding till then), "failed" (plain decoding; calibration_error says why) or "off"
        (calibrate_costs False: costs alike)."""
        if self._calibration is not None:
            return "calibrating"
        if self.calibration_error is not None:
            return "failed"
        return "calibrated" if self._calibrated else "off"

    def _on_draft_loaded(self, draft: Draft) -> None:
        """Loader thread: a draft loaded after calibration gets its cost measured once."""
        costs = self.costs
        if self._measure_loads and draft.id not in costs.draft_s | costs.draft_overhead_s:
            measure_draft_cached(self.target, draft, costs, self.settings.k_max)

    @property
    def budget_bytes(self) -> int:
        """The budget now: the working set holds it (settings.budget only sizes the start)."""
        ws = self.working_set
        return ws.budget_bytes if ws is not None else self.settings.budget_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget live (evicts to fit; BudgetExceeded if pinned drafts block)."""
        if budget_bytes < self.reserved_bytes:
            raise BudgetExceeded(
                f"budget {format_size(budget_bytes)} is below what the target needs "
                f"({format_size(self.reserved_bytes)})",
                param="budget",
            )
        self._ws.budget_bytes = budget_bytes

    # --- drafts -------------------------------------------------------------------------
    def manifest(self, draft_id: str) -> DraftManifest:
        check_id(draft_id)
        if draft_id in self.skipped_drafts and draft_id not in self.manifests:
            raise skipped_error(draft_id, self.skipped_drafts[draft_id])
        if draft_id not in self.manifests:
            raise UnknownDraft(
                f"unknown draft {draft_id!r}; known: {', '.join(sorted(self.manifests))}",
                param="draft",
            )
        return self.manifests[draft_id]

    def draft_ask(self, draft: str) -> DraftAsk:
        """A request's `draft` field decoded; a named draft is checked before anything runs
        (unknown: 404, incompatible: 400)."""
        ask = DraftAsk.parse(draft)
        if ask.named is not None:
            self.usable(ask.named)
        return ask

    @property
    def incompatible(self) -> dict[str, str]:
        """Drafts that speak another tokenizer than the target, with the reason."""
        return self.draft_source.refused

    def usable(self, draft_id: str) -> DraftManifest:
        """The manifest of a draft this target can use: UnknownDraft, or DraftIncompatible."""
        m = self.manifest(draft_id)
        reason = self.incompatible.get(draft_id)
        if reason is not None:
            raise incompatible_error(draft_id, reason)
        return m

    @property
    def drafts(self) -> dict[str, Draft]:
        """Resident drafts, in load order, leased to the calling thread until its next
        generate() (or working_set.release_leases()): safe to use their backends meanwhile."""
        ws = self.working_set
        return {d.id: d for d in ws.lease_resident()} if ws is not None else {}

    def load_draft(self, draft_id: str) -> Draft:
        """Load now (evicting lower-value drafts if the budget needs it); retries a failed
        draft. ModelLoadError on a bad file, BudgetExceeded if pinned drafts block it,
        DraftIncompatible if it speaks another tokenizer."""
        self.usable(draft_id)
        return self._ws.load(draft_id)

    def evict_draft(self, draft_id: str) -> None:
        if self.manifest(draft_id).id not in self.incompatible:  # never loaded: evicted already
            self._ws.evict(draft_id)

    def pin(self, draft_id: str, pinned: bool = True) -> None:
        if pinned:
            self.usable(draft_id)
            self._ws.pin(draft_id)
        elif self.manifest(draft_id).id not in self.incompatible:  # those are never pinned
            self._ws.unpin(draft_id)

    def unload_draft(self, draft_id: str) -> None:
        """Evict even if pinned."""
        ws = self.working_set
        if ws is not None and draft_id not in self.incompatible:
            ws.unpin(draft_id)
            ws.evict(draft_id)

    def draft_bytes(self, draft_id: str) -> int:
        """Modelled bytes the draft takes when resident (memspec.memory.footprint)."""
        self.manifest(draft_id)
        try:
            return self.draft_source.draft_bytes(draft_id)
        except (ModelLoadError, OSError, ValueError):
            return 0

    def draft_status(self) -> list[dict]:
        """One row per known draft: what status/admin/ctl report."""
        ws_rows = {r["id"]: r for r in self.working_set.status()} if self.working_set else {}
        rows = []
        for m in self.manifests.values():
            w = ws_rows.get(m.id, {})
            reason = self.incompatible.get(m.id)
            rows.append(
                {
                    "id": m.id,
                    "kind": m.kind,
                    "bytes": w.get("bytes", 0),
                    "resident": w.get("resident", False),
                    "pinned": w.get("pinned", False),
                    "acceptance": round(self.estimator.alpha(m.id), 4),
                    # The policy's last plan: what holding it is predicted to be worth.
                    "value": round(float(w.get("value") or 0.0), 6),
                    "requests": self.requests_per_draft.get(m.id, 0),
                    "tags": m.tags,
                    "state": w.get("state", "absent"),
                    "error": w.get("error"),
                    "load_s": w.get("load_s"),
                    "measured_bytes": w.get("measured_bytes"),
                    "compatible": reason is None,  # speaks the target's tokenizer
                    "reason": reason,
                }
            )
        return rows

    def devices(self) -> list[dict]:
        """Where the target's layers are and what each device holds (status). One row, this
        device, unless the target is split over RPC workers."""
        split, total = self.layer_split, self.target_footprint.total
        if split is None:
            layers = getattr(self.target, "n_layers", 0) + 1
            return [{"device": "local", "layers": layers, "bytes": total}]
        state = "lost" if getattr(self.target, "lost", None) else "ok"
        return [{"device": "local", "layers": split.local, "bytes": total}] + [
            {"device": e, "layers": n, "bytes": self.remote_bytes.get(e, 0), "state": state}
            for e, n in zip(split.endpoints, split.remote, strict=True)
        ]

    def modelled_bytes(self) -> int:
        """Target (weights, KV, buffers) + every draft loading, resident or evicting."""
        ws = self.working_set
        return ws.used_bytes() if ws is not None else self.reserved_bytes

    def memory_status(self) -> dict:
        """Budget, modelled use, peak, counters, and what the daemon sheds now."""
        ws = self.working_set
        out = ws.summary() if ws is not None else {"budget_bytes": self.budget_bytes}
        out["target"] = self.target_footprint.to_dict()
        out["embedding"] = self.embedding_status()
        out["context"] = self.context.to_dict()  # context per slot against drafts and slots
        rows = self.draft_status()
        absent = [r["id"] for r in rows if r["state"] in ("absent", "failed") and r["bytes"] > 0]
        resident_models = [r for r in rows if r["resident"] and r["bytes"] > 0]
        out["scheduling"] = self.scheduler.status()  # policy state, predictor (or why not)
        out["calibration"] = self.calibration  # "calibrating": plain decoding till it lands
        shedding = "evicted drafts" if resident_models else "no model draft resident"
        out["shedding"] = shedding if absent else "none"
        return out

    def new_estimator(self) -> AcceptanceEstimator:
        """Acceptance estimates with a per-kind prior for every known draft."""
        est = AcceptanceEstimator()
        for m in self.manifests.values():
            est.set_prior(m.id, draft_kind(m.kind).prior_alpha)
        return est

    @property
    def policies(self) -> tuple[str, ...]:
        """The policy names a request (or settings.policy) may use."""
        return self.scheduler.names

    # --- requests -----------------------------------------------------------------------
    def prompt_tokens(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if messages is not None:
            try:
                text = self.target.chat_prompt(messages, tools)
            except jinja2.TemplateError as e:  # the model's template refuses these messages
                raise InvalidRequest(
                    f"the model's chat template cannot render these messages: {e}",
                    param="messages",
                ) from None
            return self.target.tokenize(text, add_bos=True, special=True)
        return self.target.tokenize(prompt or "", add_bos=True)

    def request(self, ask: ClientRequest) -> GenerationRequest:
        """Check a client's request against this runtime, once: its tokens, the context,
        the draft and the policy it names. Raises the error the client gets."""
        messages, shift = ask.messages, None
        if ask.fim is not None:
            prompt = fim_prompt(self.target, ask.fim, self.fim_tokens)
        elif ask.messages is not None:
            prompt = self.prompt_tokens(messages=ask.messages, tools=ask.tools)
            messages, shift = self._shift_context(ask, prompt)
            prompt = shift.prompt if shift is not None else prompt
        elif isinstance(ask.prompt, list):
            self._check_token_ids(ask.prompt, "prompt")
            prompt = list(ask.prompt)
        else:
            prompt = self.prompt_tokens(prompt=ask.prompt or "")
        n_ctx = self.target.n_ctx
        hint = self._overflow_hint(ask) if len(prompt) >= n_ctx else ""
        param = "messages" if ask.messages is not None and prompt else "prompt"
        check_prompt(prompt, n_ctx, param, hint)
        draft = self.draft_ask(ask.draft)
        if ask.policy is not None:
            fixed = ask.policy.removeprefix("fixed:")
            if ask.policy.startswith("fixed:") and fixed in self.incompatible:  # the same 400
                self.usable(fixed)
            self.scheduler.check_policy(ask.policy)
        # A max_tokens beyond what the context holds is capped there (finish_reason length),
        # as llama-server does; only a prompt that does not fit is refused.
        max_tokens = ask.max_tokens or self.settings.default_max_tokens
        params = SamplingParams(
            max_tokens=min(max_tokens, n_ctx - len(prompt)),
            temperature=ask.temperature,
            top_p=ask.top_p,
            seed=None if ask.seed is None else ask.seed % 2**64,
            stop=ask.stop,
            logit_bias=self._logit_bias(ask),
            logprobs=ask.logprobs,
            stop_token_ids=self._stop_tokens(ask),
            **{
                name: getattr(ask, name)
                for name in SAMPLING_FIELDS
                if getattr(ask, name) is not None
            },
        )
        if ask.grammar is not None:  # parsed against the target's vocabulary: a bad one is a 400
            params.grammar = Grammar(ask.grammar, self.target.path, param=ask.grammar_param)
        report = shift.report() if shift is not None else None
        return GenerationRequest(
            prompt, params, draft, ask.policy, messages, ask.cache_partition, report
        )

    def _overflow_hint(self, ask: ClientRequest) -> str:
        """What a client whose prompt does not fit can do about it."""
        if self._shifts(ask):
            return ", and dropping its older turns would not make it fit. Shorten it."
        if ask.messages is not None:
            return '. Shorten the conversation, or send context_overflow: "shift".'
        return ". Shorten the prompt."

    def _shifts(self, ask: ClientRequest) -> bool:
        """A chat whose overflow shifts the context (the request's choice, else the setting)."""
        overflow = ask.context_overflow or self.settings.context_overflow
        if overflow not in ("error", "shift"):
            raise InvalidRequest(
                f'context_overflow must be "error" or "shift", not {overflow!r}',
                param="context_overflow",
            )
        return ask.messages is not None and overflow == "shift"

    def _shift_context(
        self, ask: ClientRequest, prompt: list[int]
    ) -> tuple[list[dict[str, str]] | None, Shifted | None]:
        """context_overflow "shift": a chat whose prompt and max_tokens exceed the context
        keeps its system prompt and drops its oldest turns (memspec.engine.context_shift).
        Returns the messages kept and the shift (None: none needed, or none possible)."""
        max_tokens = ask.max_tokens or self.settings.default_max_tokens
        n_ctx = self.target.n_ctx
        if not self._shifts(ask) or ask.messages is None or len(prompt) + max_tokens <= n_ctx:
            return ask.messages, None

        def render(messages: list[dict[str, Any]]) -> list[int]:
            return self.prompt_tokens(messages=messages, tools=ask.tools)

        shift = shift_messages(ask.messages, len(prompt), render, n_ctx, max_tokens)
        if shift is None:
            return ask.messages, None
        log.info(
            "context shift: %d messages (%d tokens) dropped to fit n_ctx %d",
            shift.dropped_messages, shift.dropped_tokens, n_ctx,
        )  # fmt: skip
        return shift.messages, shift

    def _logit_bias(self, ask: ClientRequest) -> dict[int, float]:
        """logit_bias, checked, with ignore_eos's ban on the end-of-generation tokens."""
        self._check_token_ids(ask.logit_bias, "logit_bias")
        bias = dict(ask.logit_bias)
        if ask.ignore_eos:
            bias.update(dict.fromkeys(self.target.eos_token_ids, -math.inf))
        return bias

    def _check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """InvalidRequest naming `param` if an id is outside the target's vocabulary."""
        n_vocab = self.target.n_vocab
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"{param}: token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                param=param,
            )

    def _stop_tokens(self, ask: ClientRequest) -> frozenset[int]:
        """stop_token_ids, checked; a FIM prompt's middle also ends at the FIM end tokens."""
        self._check_token_ids(ask.stop_token_ids, "stop_token_ids")
        fim_end = self.fim_tokens.end if ask.fim is not None and self.fim_tokens else frozenset()
        return frozenset(ask.stop_token_ids) | fim_end

    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The target's fill-in-the-middle tokens (None: it has none)."""
        return find_fim_tokens(self.target)

    def prepare_prefix(
        self,
        cache: PrefixCache,
        prompt: list[int],
        use_drafts: bool,
        slot: int = 0,
        partition: str = "",
    ) -> int:
        """Ready a slot of the target's (and, when drafting in the lead slot, each model
        draft's) KV cache for `prompt` of `partition` from `cache`, else from the target's
        other slots (those the slot table has busy are read but never written). Returns the
        prompt tokens a restored target snapshot or another slot's copy covers (0: none)."""
        with self.lock:  # a background scheduler may load/evict drafts
            drafts = [d.backend for d in self.drafts.values() if isinstance(d, ModelBacked)]
            cache.forget([self.target, *drafts])
            mine = self.target.slots[slot]
            restored = cache.prepare(mine, prompt, partition)
            others = self.target.slots
            busy = self.slot_table.busy() - {slot}  # `slot` itself is readied: written
            free = [s for s in others if s.seq_id not in busy]
            park = not cache.enabled_for(mine)
            restored = share_slot_prefix(mine, others, free, prompt, park) or restored
            if use_drafts and slot == LEAD_SLOT:
                for be in drafts:
                    cache.prepare(be, prompt, partition)
        return restored

    # --- generation ---------------------------------------------------------------------
    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        draft: str = "auto",
        k: int | None = None,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        estimator: AcceptanceEstimator | None = None,
        policy: str | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> Generation:
        """Decode one request alone on the lead slot (the fields of a GenerationRequest, or
        a tool's own, with a fixed `k` or its own `estimator`): the daemon's path, a batch of
        one. A named draft that is not resident is loaded first (counted as stall); if that
        load fails the request decodes without it (output identical: the target decides every
        token) and the draft's status says why."""
        req = GenerationRequest(prompt, params, self.draft_ask(draft), policy, messages)
        seq = self.open_sequence(req, LEAD_SLOT, on_token, cancel, k=k, estimator=estimator)
        while not seq.done:
            self.decode_round([seq])
        return self.close_sequence(seq)

    # --- batched decoding (the daemon's engine thread) ------------------------------------
    def open_sequence(
        self,
        req: GenerationRequest,
        slot: int = 0,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        alone: bool = True,
        k: int | None = None,
        estimator: AcceptanceEstimator | None = None,
    ) -> Sequence:
        """Start `req` on a slot of the target. The lead slot (LEAD_SLOT): the scheduler
        decides its rounds over every resident draft, by the request's policy. The others
        draft with free drafts only (Scheduler.beside_lead: the decision rule, `auto`).
        Not `alone` (other requests decode beside it), a lead left to the configured `memspec`
        policy runs the decision rule over what is resident (`auto`): memspec's residency
        planning per request would load and evict drafts that a batch seldom runs, on the
        cores the batch needs (measured: TTFT p50 1.1 s against 0.19 s at 4 streams). The
        Generation says which policy the request ran under and whether it led."""
        backend = self.target.slots[slot]
        lead = slot == LEAD_SLOT
        if lead:
            self._lead_stall0 = self._ws.thread_stall_s()
            policy_name = req.policy or self.settings.policy
            if not alone and req.policy is None and policy_name == "memspec":
                policy_name = "auto"
            ran = self.scheduler.begin(
                req.prompt,
                req.params,
                draft=req.draft,
                k=k,
                policy=policy_name,
                messages=req.messages,
                estimator=estimator,
            )
            policy: RoundPolicy = self.scheduler
        else:
            policy = self.scheduler.beside_lead(req.draft)
            ran = "none" if req.draft.plain else "auto"
        try:
            seq = Sequence(backend, req.prompt, req.params, policy, on_token, cancel)
        except BaseException:
            if lead:
                self.scheduler.abort()
            raise
        seq.gen.policy, seq.gen.lead = ran, lead
        seq.gen.context_shift = req.context_shift
        return seq

    def decode_round(self, sequences: list[Sequence]) -> tuple[int, int]:
        """One round of every open sequence, in one forward pass of the target: the
        (sequences, tokens) it carried."""
        self._ws.release_leases()  # the last round's proposals are verified by now
        ordered = sorted(sequences, key=lambda s: s.target.seq_id)  # the lead chooses first
        with self.lock:
            return decode_round(self.target, ordered, self.costs, self.settings.prefill_chunk)

    def close_sequence(self, seq: Sequence) -> Generation:
        """End a finished sequence: its Generation, or the error it failed with (raised)."""
        lead = seq.target.seq_id == LEAD_SLOT
        if lead:
            if seq.error is None:
                self.scheduler.finish()
            else:
                self.scheduler.abort()
        if seq.error is not None:
            raise seq.error
        gen = seq.result()
        if lead:  # waits on reactive loads happen in the lead's rounds
            gen.stall_s = self._ws.thread_stall_s() - self._lead_stall0
        for d in self._ws.lease_resident():  # learning datastores file the output now
            if isinstance(d, DatastoreDraft) and d.learn:
                d.finish_request(gen.token_ids)
        self._ws.release_leases()
        self.requests_per_draft.update(gen.drafts_used.keys())
        if lead:
            self.memory.request_done()
        return gen

    # --- embeddings ---------------------------------------------------------------------
    def embedder(self) -> LlamaEmbedder:
        """The embedding context (memspec.backends.embedding), set up on first use on
        settings.embedding_model, else on the target's loaded weights. Its footprint is
        charged to the budget before it is allocated (drafts evicted to make room):
        BudgetExceeded if the target and the pinned drafts leave too little."""
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = self._load_embedder()
            return self._embedder

    def _load_embedder(self) -> LlamaEmbedder:
        from memspec.drafts.gguf_header import open_header, scalar

        s = self.settings
        target_path = resolve_model_path(s.target)
        path = resolve_model_path(s.embedding_model) if s.embedding_model else target_path
        if not path.is_file():
            raise ModelLoadError(f"embedding model not found: {path}", param="model")
        header = open_header(path)
        arch = scalar(header, "general.architecture") or "llama"
        keys = ("pooling_type", "context_length", "attention.causal")
        meta = {f"{arch}.{k}": scalar(header, f"{arch}.{k}") for k in keys}
        plan = plan_embedding({"general.architecture": arch, **meta}, s.n_ctx)
        # The target's own llama_model, when it is loaded in this process by llama.cpp.
        llm = getattr(self.target, "_llm", None) if path == target_path else None
        shared = getattr(llm, "_model", None)
        fp = embedding_footprint(
            read_shape(path), plan.n_ctx, plan.n_batch, shared is not None, s.n_gpu_layers
        )
        self._ws.reserve(fp.total, f"the embedding context ({path.name}, n_ctx {plan.n_ctx})")
        try:
            emb = LlamaEmbedder(
                path,
                plan,
                shared,
                n_threads=self.options.n_threads or os.cpu_count() or 1,
                n_gpu_layers=s.n_gpu_layers,
                use_mmap=self.options.use_mmap,
            )
        except BaseException:
            self._ws.reserve(-fp.total, "")
            raise
        self.embedding_footprint = fp
        log.info(
            "embeddings: %s, %s pooling, n_ctx %d, %s", path.name, plan.pooling_name,
            emb.n_ctx, format_size(fp.total),
        )  # fmt: skip
        return emb

    def release_embedder(self) -> bool:
        """Free the embedding context and give its bytes back (waits for an input being
        embedded). False if none was loaded."""
        with self._embedder_lock:
            emb, self._embedder = self._embedder, None
            if emb is None:
                return False
            emb.close()
            fp, self.embedding_footprint = self.embedding_footprint, None
            if fp is not None and self.working_set is not None:
                self.working_set.reserve(-fp.total, "")
            return True

    def embedding_status(self) -> dict[str, Any]:
        """What status reports: loaded or not, and, loaded, its bytes by part and its setup."""
        emb, fp = self._embedder, self.embedding_footprint
        model = self.settings.embedding_model or self.settings.target
        if emb is None or fp is None:
            return {"loaded": False, "model": Path(model).name}
        return {"loaded": True, **emb.describe(), "bytes": fp.to_dict()}

    def close(self) -> None:
        for draft_id, draft_s in self.costs.draft_s.items():  # for a reload (drafts_join_later)
            _draft_costs[(self._target_file, draft_id)] = (
                draft_s,
                self.costs.draft_overhead_s.get(draft_id),
            )
        self.release_embedder()  # before the target: it may sit on the target's model
        if self.working_set is not None and hasattr(self, "scheduler"):
            self.memory.save()
        ws, self.working_set = self.working_set, None
        if ws is not None:
            ws.close()
        self.target.close()
