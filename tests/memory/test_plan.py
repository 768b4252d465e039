"""The footprint model's inputs (GGUF hyper-parameters) and the budget plan."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from memspec.cli import main
from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
from memspec.errors import ModelLoadError
from memspec.memory.footprint import draft_footprint, model_footprint, target_footprint
from memspec.memory.gguf_info import read_shape
from memspec.memory.plan import make_plan
from memspec.paths import models_dir

TARGET = "smollm2-135m-f32.gguf"


BASE_POOL = {"prompt-lookup", "q8_0", "q4_0", "q2_k"}  # the testbed's pool; others may be added


@pytest.fixture(scope="module")
def manifests():
    return {k: m for k, m in load_manifests(DEFAULT_MANIFEST_DIR).items() if k in BASE_POOL}


@pytest.fixture(scope="module")
def target_path():
    p = models_dir() / TARGET
    if not p.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    return p


@pytest.mark.models
def test_gguf_shape_matches_what_llama_cpp_loads(small_backend, target_path):
    s = read_shape(target_path)
    assert (s.n_layers, s.n_head_kv, s.head_dim_k, s.head_dim_v) == (
        small_backend.n_layers,
        small_backend.n_kv_heads,
        small_backend.head_dim_k,
        small_backend.head_dim_v,
    )
    assert s.n_vocab == small_backend.n_vocab
    assert s.kv_bytes_per_token == small_backend.kv_bytes_per_token()
    assert (s.n_swa, s.swa_layers) == (0, 0)  # no sliding window: every layer full size
    # F32 weights: 4 bytes per parameter, and the file is weights + a header.
    assert s.bytes_by_type == {"F32": s.weight_bytes}
    assert 0 < s.file_bytes - s.weight_bytes < 4_000_000


def test_gguf_shape_of_the_second_family():
    """Gemma 3 270M: a 262,144-token vocabulary and heads of 256 (not embedding / heads = 160)."""
    from launcher import require_gemma

    from memspec.backends.base import BackendOptions, load_backend

    path = require_gemma()
    s = read_shape(path)
    be = load_backend(path, BackendOptions(n_ctx=256, n_threads=1))
    try:
        assert (
            (s.n_vocab, s.head_dim_k, s.head_dim_v) == (be.n_vocab, 256, 256) == (262_144, 256, 256)
        )
        assert s.n_head_kv == be.n_kv_heads and s.n_layers == be.n_layers
        assert s.kv_bytes_per_token == be.kv_bytes_per_token()  # 256 cells: inside the window
        # Five layers in six attend to a 512-token window (llama.cpp's own count agrees).
        assert (s.n_swa, s.swa_layers) == (512, 15) and be._n_swa == 512
    finally:
        be.close()


@pytest.mark.models
def test_footprint_parts_follow_n_ctx_and_k(target_path):
    s = read_shape(target_path)
    a, b = model_footprint(s, 512, 1), model_footprint(s, 1024, 1)
    assert b.kv == 2 * a.kv and b.weights == a.weights
    assert b.scratch > a.scratch  # attention over a longer context
    k1, k8 = target_footprint(target_path, 1024, 1), target_footprint(target_path, 1024, 8)
    assert k8.candidates - k1.candidates == 2 * 7 * s.n_vocab * 4  # (k+1) rows, twice
    assert k8.total > k1.total and k8.at_load < k8.total


def test_missing_or_garbage_files_are_load_errors(tmp_path):
    with pytest.raises(ModelLoadError):
        read_shape(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError):
        read_shape(bad)
    with pytest.raises(ModelLoadError):
        draft_footprint("model", tmp_path / "nope.gguf", 512)


@pytest.mark.models
def test_plan_ladder(target_path, manifests):
    def plan(budget: int, **kw):
        return make_plan(budget, target_path, manifests, models_dir(), n_ctx=1024, **kw)

    everything = plan(10**12)
    assert everything.fits and everything.shed == [] and len(everything.resident) == 4
    assert everything.evict_order[0] == "q8_0"  # equal priors: the largest goes first
    # Room for the target and two drafts: the best value per byte are kept.
    two = {d.id: d.bytes for d in everything.drafts}
    budget = everything.target.total + two["q2_k"] + two["q4_0"] + 1_000_000
    p = plan(budget)
    assert p.shed == ["evict drafts"] and set(p.resident) == {"prompt-lookup", "q2_k", "q4_0"}
    assert p.used_bytes <= budget
    # At the lower bound exactly, it still speculates with the smallest model draft, at k=1.
    lb = everything.lower_bound_bytes
    assert everything.lower_bound_draft == "q2_k"
    p = plan(lb)
    assert p.fits and "q2_k" in p.resident and p.k == 1 and p.planned_n_ctx == 1024
    assert p.shed == ["evict drafts", "shorten k"]
    # A little less: a shorter context keeps a draft.
    p = plan(lb - 20_000_000)
    assert p.fits and "shorten n_ctx" in p.shed and p.planned_n_ctx < 1024
    assert "q2_k" in p.resident and p.used_bytes <= lb - 20_000_000
    # Target only: plain decoding (prompt lookup needs no memory).
    p = plan(everything.target_only_bytes + 4_000_000)
    assert p.fits and p.resident == ["prompt-lookup"] and "plain decoding" in p.shed
    assert not plan(100_000_000).fits
    # Values change what is kept: q8_0 valued highly enough wins its bytes back.
    p = plan(budget, values={"q8_0": 10.0})
    assert "q8_0" in p.resident


@pytest.mark.models
def test_plan_cli_json_and_text(target_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--budget", "1GB", "--n-ctx", "1024", "--json"])
    data = json.loads(out.getvalue())
    assert rc == 0 and data["fits"] and data["budget_bytes"] == 10**9
    # Whatever the pool holds: evicted lowest value per byte first, q8_0 before q2_k.
    rows = {d["id"]: d for d in data["drafts"]}
    vpb = [rows[i]["value"] / rows[i]["bytes"] for i in data["evict_order"]]
    assert vpb == sorted(vpb)
    assert data["evict_order"].index("q8_0") < data["evict_order"].index("q2_k")
    assert data["lower_bound_bytes"] < 10**9 and data["used_bytes"] <= 10**9
    assert set(data["resident"]) <= {i for i, d in rows.items() if d["footprint"]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--budget", "100MB"])
    assert rc == 1 and "does NOT fit" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--budget", "900MB"])
    text = out.getvalue()
    assert "lower bound that still speculates" in text and "eviction order" in text


@pytest.mark.models
def test_longest_context_is_the_last_that_fits(target_path, manifests):
    """The trade `memspec plan` shows: per KV cache type, the longest context (256-cell steps)
    whose footprint fits beside the residents; one step more does not. A quantized cache or
    flash attention (no attention scores that grow with the context) holds more."""
    from memspec.kv_cache import KVCache
    from memspec.memory.plan import longest_context

    budget = 1 << 30
    got = {}
    for kv in (KVCache(), KVCache("f16", "f16", True), KVCache("q8_0", "q8_0", True)):
        n = longest_context(budget, target_path, 8, lambda n: 100 << 20, kv_cache=kv)
        fp = target_footprint(target_path, n, 8, kv_cache=kv).total + (100 << 20)
        over = target_footprint(target_path, n + 256, 8, kv_cache=kv).total + (100 << 20)
        assert n % 256 == 0 and fp <= budget < over, kv
        got[kv.describe()] = n
    assert list(got.values()) == sorted(got.values()) and len(set(got.values())) == 3, got
    assert longest_context(1 << 20, target_path, 8) == 0  # not even the shortest fits
    plan = make_plan(budget, target_path, manifests, models_dir(), n_ctx=1024, k_max=8)
    table = plan.context_by_kv
    assert set(table) == {
        "K f16, V f16",
        "K f16, V f16, flash attention",
        "K q8_0, V q8_0, flash attention",
        "K q4_0, V q4_0, flash attention",
    }
    assert all(row[1] >= 1024 for row in table.values())  # the plan's own n_ctx fits


@pytest.mark.models
def test_n_ctx_auto_never_exceeds_the_budget_with_every_slot_full(target_path, manifests):
    """n_ctx auto (plan_context), for budgets from the target's least to past the trained
    context, one slot, three and auto: the target with every slot full at the resolved
    context, beside the drafts kept at that context, fits the budget; a 256-cell step more
    does not (or the trained context caps it); the drafts kept are those that fit beside
    2,048 tokens, in preload order."""
    from memspec.kv_cache import KVCache
    from memspec.memory.plan import (
        AUTO_FLOOR_N_CTX,
        draft_fits,
        plan_context,
        trained_context,
    )

    trained = trained_context(target_path)
    order = ["prompt-lookup", "q2_k", "q4_0", "q8_0"]

    def drafts_at(n: int):
        fits = {d.id: d for d in draft_fits(manifests, models_dir(), n)}
        return [fits[i] for i in order]

    def used(n: int, slots: int, kept: list[str], kv: KVCache | None = None) -> int:
        drafts = sum(d.bytes for d in drafts_at(n) if d.id in kept)
        kv = kv or KVCache()
        return target_footprint(target_path, n, 8, slots=slots, kv_cache=kv).total + drafts

    least = target_footprint(target_path, 256, 8).total
    for budget in (least + (8 << 20), 700 << 20, 1 << 30, 3 << 30, 8 << 30):
        for parallel in (1, 3, 0):
            p = plan_context(budget, target_path, 8, drafts_at, "auto", parallel)
            if p.n_ctx == 0:  # not even 256 tokens a slot: refused at start
                assert parallel == 3 and used(256, 3, []) > budget
                continue
            assert p.auto and p.n_ctx % 256 == 0 and 256 <= p.n_ctx <= trained, (budget, p)
            assert p.slots == parallel or parallel == 0
            assert used(p.n_ctx, p.slots, p.drafts) <= budget, (budget, parallel, p)
            assert p.target_bytes + p.drafts_bytes == used(p.n_ctx, p.slots, p.drafts)
            if p.n_ctx < trained:
                assert used(p.n_ctx + 256, p.slots, p.drafts) > budget
                assert p.slots == (parallel or 1)  # the context first: one slot
            else:
                assert p.limited_by == "trained context"
            # Drafts kept as the preload keeps them: each that fits beside the floor context.
            room = (
                budget
                - target_footprint(target_path, AUTO_FLOOR_N_CTX, 8, slots=parallel or 1).total
            )
            for d in drafts_at(AUTO_FLOOR_N_CTX):
                if d.bytes <= room:
                    assert d.id in p.drafts
                    room -= d.bytes
                else:
                    assert d.id in p.left_out
            assert p.without_drafts >= p.n_ctx
    # A big budget: the trained context, then more slots of it.
    p = plan_context(8 << 30, target_path, 8, drafts_at, "auto", 0)
    assert p.n_ctx == trained and p.slots > 1 and p.drafts == order
    assert used(trained, p.slots, p.drafts) <= 8 << 30
    # A quantized cache with flash attention: more drafts beside the floor context (the
    # drafts that pay are kept first), and more context with none.
    q8 = KVCache("q8_0", "q8_0", True)
    p16 = plan_context(1 << 30, target_path, 8, drafts_at, "auto", 1)
    p8 = plan_context(1 << 30, target_path, 8, drafts_at, "auto", 1, kv_cache=q8)
    assert set(p16.drafts) < set(p8.drafts) and used(p8.n_ctx, 1, p8.drafts, q8) <= 1 << 30
    assert p8.n_ctx >= AUTO_FLOOR_N_CTX


@pytest.mark.models
def test_plan_cli_shows_the_auto_context(target_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--budget", "1GiB", "--n-ctx", "auto", "--json"])
    data = json.loads(out.getvalue())
    ctx = data["context"]
    assert rc == 0 and ctx["auto"] and data["n_ctx"] == data["planned_n_ctx"] == ctx["n_ctx"]
    assert set(data["resident"]) == set(ctx["drafts"]) and data["used_bytes"] <= 1 << 30
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--budget", "1GiB", "--n-ctx", "auto"])
    assert f"n_ctx auto: {ctx['n_ctx']:,} tokens per slot" in out.getvalue()
