"""The composition root: a target, its drafts, measured costs and the scheduler, from settings.

Drafts live in a WorkingSet (memspec.scheduler.working_set): resident under the memory budget
(target + its KV and buffers, charged first, then drafts), loaded and evicted by one background
thread. The working set is the budget's one holder: settings.budget sizes the start, and
`set_budget` (a live tune) changes it there. The Scheduler (memspec.scheduler.rounds) decides
every round over it: every round of the lead slot (LEAD_SLOT), and the free-draft rule of the
slots beside it.

The Runtime builds and wires the parts that serve one target, each in a module of its own:
`requests` (memspec.request_check) checks a client's request once into a GenerationRequest
whose fields `generate()` and `open_sequence()` decode (tools that hold token ids call
`generate()` directly); `draft_admin` (memspec.draft_admin) is what requests and the admin API
name drafts by; `embeddings` (memspec.embeddings) holds the embedding context. What is left
here is the load, in named steps (`__init__`), and the engine's calls: a sequence's rounds,
prefix reuse, calibration left for idle time (`calibrate_pending`), budget and status.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.config import Settings
from memspec.draft_admin import DraftAdmin
from memspec.drafts.compat import check_draft, fingerprint_of
from memspec.drafts.datastore import DatastoreDraft
from memspec.drafts.family import settings_pool_dir, skipped_recipes
from memspec.drafts.manifest import DraftManifest, load_manifests
from memspec.drafts.registry import draft_kind
from memspec.embeddings import Embeddings
from memspec.engine.calibration import Calibration, measure_draft_cached
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.prefix_cache import PrefixCache, share_slot_prefix
from memspec.engine.slots import SlotTable
from memspec.engine.speculative import (
    Generation,
    Sequence,
    TokenCallback,
    decode_round,
)
from memspec.engine.types import Draft, ModelBacked, RoundPolicy, SamplingParams
from memspec.errors import (
    BudgetExceeded,
    LoadAbandoned,
    MemSpecError,
    ModelLoadError,
)
from memspec.memory.footprint import (
    Footprint,
    split_footprint,
    target_footprint,
)
from memspec.memory.gguf_info import read_shape
from memspec.memory.plan import MIN_N_CTX, ContextPlan, DraftFit, draft_fits, fit_hint, plan_context
from memspec.model_id import model_aliases, served_model_id
from memspec.paths import data_dir, models_dir, resolve_model_path
from memspec.predictor.artifacts import predictor_path
from memspec.predictor.model import load_or_fallback
from memspec.request_check import GenerationRequest, RequestCheck
from memspec.rpc.endpoints import LayerSplit, layer_split
from memspec.scheduler.learned import Memory
from memspec.scheduler.manifest_source import ManifestSource
from memspec.scheduler.rounds import LEAD_SLOT, Scheduler
from memspec.scheduler.working_set import WorkingSet
from memspec.units import format_size

log = logging.getLogger(__name__)


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
        target_path = resolve_model_path(settings.target)
        self._target_file = str(target_path)  # the key of its drafts' costs (_draft_costs)
        self._read_pool(settings, target_path)
        self._plan_target(target_path, batched)
        self._init_costs()
        _stage("the target")
        self.target: Backend = target or load_backend(
            target_path, self.options, self.settings.backend
        )
        self._serve_target(target_path)
        try:
            self._load_drafts(target_path, calibrate_costs, defer_calibration)
            self._start_scheduler(target_path)
        except Exception:
            self.close()
            raise

    # --- the steps of a load, in order ---------------------------------------------------
    def _read_pool(self, settings: Settings, target_path: Path) -> None:
        """The draft manifests of the target's pool, what is preloaded (settings.drafts, else
        the whole family as far as it is built) and the target's tokenizer, which every
        manifest is checked against once (drafts that speak another are left out)."""
        pool = settings_pool_dir(settings)
        self.manifest_errors: dict[str, str] = {}  # manifests left out (file stem -> why)
        self.preload_errors: dict[str, str] = {}  # drafts named at start but left out (id -> why)
        self.manifests: dict[str, DraftManifest] = load_manifests(pool, self.manifest_errors)
        for name, why in self.manifest_errors.items():
            log.error("draft manifest %s left out: %s", name, why)
        self.preload_ids = (
            list(settings.drafts) if settings.drafts is not None else self._whole_family()
        )
        self.target_tokenizer = fingerprint_of(target_path)
        # Recipes a target's family skipped (e.g. a Q4 self-draft of a Q4 target): named in
        # settings.drafts they are passed over with the reason, named in a request refused.
        self.skipped_drafts: dict[str, str] = skipped_recipes(pool)

    def _plan_target(self, target_path: Path, batched: bool) -> None:
        """Slots and context (n_ctx "auto" resolved into self.settings), the layer split over
        RPC workers, the backend options, and the target's footprint, charged first:
        BudgetExceeded, with what would fit, if the budget cannot hold it."""
        self.context: ContextPlan = self._plan_slots(self.settings, target_path, batched)
        self.slots = self.context.slots
        if self.settings.n_ctx == "auto":
            log.info("n_ctx auto: %s", self.context.describe())
            n_ctx = self.context.n_ctx or MIN_N_CTX  # 0: refused below, with the numbers
            self.settings = self.settings.model_copy(update={"n_ctx": n_ctx})
        settings = self.settings
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
        # A head drafts from the target's features: a target with one it can use loads them.
        if any(self._usable_head(m) for m in self.manifests.values()):
            self.options = replace(self.options, features=True)
        self._charge_target(target_path)

    def _charge_target(self, target_path: Path) -> None:
        """The target and its KV caches (one per slot) and buffers, charged first; split over
        workers, this device's budget pays its share and each worker the rest."""
        settings = self.settings
        self.target_footprint: Footprint = target_footprint(
            target_path,
            settings.n_ctx,
            settings.k_max,
            settings.n_gpu_layers,
            self.slots,
            settings.kv_cache,
        )
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

    def _init_costs(self) -> None:
        """Costs alike until calibrated ones are adopted, in place (_calibrate)."""
        self.costs = CostModel.alike(self.settings.k_max)
        self._calibration: Calibration | None = None  # one left for calibrate_pending()
        self._calibrated = False
        self.calibration_error: str | None = None
        self._later: list[str] = []  # drafts that join when they pay (drafts_join_later)
        self._measure_loads = False  # drafts loaded after calibration get their cost measured
        self._lead_stall0 = 0.0  # the working set's stall clock when the lead slot's began
        self.estimator = self.new_estimator()
        self.lock = threading.Lock()  # one decode loop at a time owns the models

    def _serve_target(self, target_path: Path) -> None:
        """What the loaded target is served as: its slots, names and chat template, the
        parts built on it (what requests and admins name, the embedding context), and what
        earlier runtimes learnt about it. A chat template that cannot work fails the load."""
        settings = self.settings
        # Which of the target's sequence slots hold a sequence (the daemon takes and releases).
        self.slot_table = SlotTable(self.target.slots, lead=LEAD_SLOT)
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
        self.draft_admin = DraftAdmin(
            self.manifests,
            self.skipped_drafts,
            self.draft_source,
            lambda: self.working_set,
            self.estimator,
        )
        # The embedding context: set up by the first embedding request.
        self.embeddings = Embeddings(
            lambda: self.settings, self.target, self.options, self._reserve
        )
        # What earlier runtimes learnt about this target (memspec.scheduler.learned).
        self.memory = Memory(self, settings.state_dir or data_dir() / "state", self.target.path)
        if settings.drafts is None:  # the default pool: what was resident last time first
            last = self.memory.resident
            self.preload_ids = last + [i for i in self.preload_ids if i not in last]

    def _load_drafts(self, target_path: Path, calibrate_costs: bool, defer: bool) -> None:
        """The working set, the preload (but the drafts that join later), then the costs:
        read from the caches, measured, or left for calibrate_pending (`defer`)."""
        _stage("the drafts")
        # Only the preload ids are loaded, weightless ones included: "auto" then uses
        # exactly what the configuration names until something else is loaded.
        self.working_set = WorkingSet(
            self.draft_source,
            self.settings.budget_bytes,
            self.target_footprint.total,
            on_loaded=self._on_draft_loaded,
            autoload_free=False,
        )
        later = self._drafts_for_later(self.settings, target_path)
        self._preload(self.working_set, [i for i in self.preload_ids if i not in later])
        with self.working_set.leased():
            resident = list(self.drafts.values())
        self._later = later
        if calibrate_costs:
            _stage("calibration")
            self._calibrate(resident, defer)
        if later:
            log.info("drafts %s join later, when they pay", ", ".join(later))

    def _start_scheduler(self, target_path: Path) -> None:
        """The scheduler that decides every round (with the predictor, or per-kind priors),
        what it learnt last time restored, and the request check that names its policies."""
        predictor = load_or_fallback(predictor_path(target_path, self.settings.predictor))
        if predictor.error:
            log.warning("predictor: %s; using per-kind priors", predictor.error)
        self.scheduler = Scheduler(
            self._ws, self.costs, self.estimator, self.settings.k_max, predictor
        )
        self.memory.restore()
        self.requests = RequestCheck(
            self.target, lambda: self.settings, self.draft_admin, self.scheduler.check_policy
        )

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
                self.draft_admin.manifest(draft_id)
            except MemSpecError as e:
                log.error("draft %s left out at start: %s", draft_id, e.message)
                self.preload_errors[draft_id] = e.message
                continue
            reason = self.draft_admin.incompatible.get(draft_id)
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
            with self._ws.leased():
                measured = calibration.run(list(self.drafts.values()), stop, self.lock)
        except Exception as e:  # noqa: BLE001 - the model goes on serving, plain
            log.exception("%s: calibration failed; decoding plain", self.target.path.name)
            self._calibration, self.calibration_error = None, str(e)
            return True
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

    # --- drafts ---------------------------------------------------------------------
    @property
    def drafts(self) -> dict[str, Draft]:
        """Resident drafts, in load order, leased to the calling thread until the end of its
        `working_set.leased()` scope (the engine's: its next round): safe to use meanwhile."""
        ws = self.working_set
        return {d.id: d for d in ws.lease_resident()} if ws is not None else {}

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
        out["embedding"] = self.embeddings.status()
        out["context"] = self.context.to_dict()  # context per slot against drafts and slots
        rows = self.draft_admin.draft_status()
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
        ask = self.draft_admin.draft_ask(draft)
        req = GenerationRequest(prompt, params, ask, policy, messages)
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
        ordered = sorted(sequences, key=lambda s: s.target.seq_id)  # the lead chooses first
        # The drafts the round's policies take are leased until it ends, however it ends.
        with self._ws.leased(), self.lock:
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
        with self._ws.leased():  # learning datastores file the output now
            for d in self._ws.lease_resident():
                if isinstance(d, DatastoreDraft) and d.learn:
                    d.finish_request(gen.token_ids)
        self.draft_admin.requests_per_draft.update(gen.drafts_used.keys())
        if lead:
            self.memory.request_done()
        return gen

    def _reserve(self, n_bytes: int, what: str) -> None:
        """Charge (or, negative, give back) bytes beside the drafts: the embedding context's."""
        ws = self.working_set
        if ws is not None:
            ws.reserve(n_bytes, what)
        elif n_bytes > 0:
            raise RuntimeError("the runtime is closed")

    def close(self) -> None:
        for draft_id, draft_s in self.costs.draft_s.items():  # for a reload (drafts_join_later)
            _draft_costs[(self._target_file, draft_id)] = (
                draft_s,
                self.costs.draft_overhead_s.get(draft_id),
            )
        self.embeddings.release()  # before the target: it may sit on the target's model
        if self.working_set is not None and hasattr(self, "scheduler"):
            self.memory.save()
        ws, self.working_set = self.working_set, None
        if ws is not None:
            ws.close()
        self.target.close()
