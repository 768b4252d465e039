"""The memory model against measured process memory: every draft of the pool, real loads.

Each measurement runs in its own process (python -m memspec.memory.probe), beside the resident
target as in the daemon, with llama.cpp's mmap off: the weights are copied into process memory,
so RSS grows by what the load really costs. A model draft is then driven to its worst case (the
context prefilled to the end in n_batch chunks, then one step), which is what the budget
charges for it. The estimate must be within ±15% of the RSS delta (and of the USS delta).
On a Jetson the GPU's NvMap growth, on a CUDA box the device's, is added to the process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
from memspec.memory.footprint import draft_footprint, target_footprint
from memspec.memory.measure import device_bytes
from memspec.paths import models_dir

TARGET_FILE = "smollm2-135m-f32.gguf"
N_CTX = 512  # small enough to keep the worst-case prefill quick on 2 shared cores
K_MAX = 8
TOLERANCE = 0.15
# Small drafts (a datastore of a few MB) also see the C allocator's own slack: glibc raises its
# mmap threshold after a large free, so a load's temporaries can stay on the heap. 2 MB of
# absolute slack covers that; model drafts (100+ MB) are held to the 15%.
SLACK_BYTES = 2_000_000
# A lookup draft's arrays (a few MB) could still come from heap an earlier load freed: glibc's
# dynamic mmap threshold rises after the warm-up load frees its arrays, and a CI run measured
# 0 bytes for datastore-ci. A fixed threshold keeps every array over 128 KB in its own mapping,
# so what a load allocates is what RSS shows (set for lookup drafts only; models load as
# llama.cpp does in the daemon).
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
POOL = load_manifests(DEFAULT_MANIFEST_DIR)


_PROBED: dict[tuple, dict] = {}  # the KV-type tests share their loads (each is a fresh process)


def probe(*args: str, env: dict[str, str] | None = None) -> dict:
    key = (args, tuple(sorted((env or {}).items())))
    if key in _PROBED:
        return _PROBED[key]
    out = subprocess.run(
        [sys.executable, "-m", "memspec.memory.probe", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    _PROBED[key] = json.loads(out.stdout.strip().splitlines()[-1])
    return _PROBED[key]


def check(name: str, est_at_load: int, est_steady: int, r: dict) -> None:
    for phase, est in (("at_load", est_at_load), ("steady", est_steady)):
        d = r[phase]
        for what, measured in (("rss", d["rss"]), ("uss", d["uss"]), ("device", device_bytes(d))):
            if measured is None:
                continue
            err = est / measured - 1 if measured else float("inf")
            print(
                f"{name:14s} {phase:8s} {what:6s} model {est / 1e6:8.1f} MB"
                f"  measured {measured / 1e6:8.1f} MB  {err:+.1%}"
            )
            ok = abs(est - measured) <= max(TOLERANCE * measured, SLACK_BYTES)
            assert ok, f"{name} {phase} {what}: model off by {err:+.1%}"


@pytest.fixture(scope="module")
def target_path():
    path = models_dir() / TARGET_FILE
    if not path.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    return path


@pytest.mark.models
def test_target_footprint_matches_measured(target_path):
    """The target alone in a fresh process (it pays llama.cpp's one-time cost), k+1 rows."""
    r = probe(str(target_path), "--n-ctx", str(N_CTX), "--outputs", str(K_MAX + 1))
    fp = target_footprint(target_path, N_CTX, K_MAX)
    check("target", fp.at_load, fp.total, r)


@pytest.mark.models
def test_target_footprint_with_slots_matches_measured(target_path):
    """Batched decoding: four slots, each filled to the end, then one pass verifying k + 1
    rows in every slot (issue 12: the budget holds with every slot busy)."""
    slots = 4
    r = probe(
        str(target_path), "--n-ctx", str(N_CTX), "--outputs", str(K_MAX + 1), "--slots", str(slots)
    )
    fp = target_footprint(target_path, N_CTX, K_MAX, slots=slots)
    check("target x4", fp.at_load, fp.total, r)


@pytest.mark.parametrize("draft_id", sorted(POOL))
@pytest.mark.models
def test_draft_footprint_matches_measured(target_path, draft_id):
    m = POOL[draft_id]
    path = m.model_path(models_dir()) if m.file else None
    if path is not None and not path.is_file():
        on_demand = m.build is not None and m.build.on_demand
        if m.kind == "model" and not on_demand:
            pytest.fail(f"draft {draft_id} not built ({path}): run scripts/setup.sh", pytrace=False)
        pytest.skip(f"draft {draft_id} is not built ({path.name})")
    fp = draft_footprint(m.kind, path, N_CTX, dict(m.params))
    env = FIXED_MMAP_THRESHOLD if m.kind != "model" else None
    r = probe(draft_id, "--draft", "--n-ctx", str(N_CTX), "--resident", str(target_path), env=env)
    if fp.total == 0:  # weightless (prompt lookup): nothing measurable may be allocated
        assert r["steady"]["rss"] < 2_000_000, r
        return
    check(draft_id, fp.at_load, fp.total, r)


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
@pytest.mark.models
def test_kv_cache_types_footprint_matches_measured(target_path, kv_type):
    """Each KV cache type at a context long enough for the cache to show (2,048 tokens: 47 MB
    of f16 KV on SmolLM2), flash attention on as a quantized V needs it."""
    from memspec.kv_cache import KVCache

    r = probe(str(target_path), *KV_ARGS, "--kv-type-k", kv_type, "--kv-type-v", kv_type)
    fp = target_footprint(target_path, KV_N_CTX, K_MAX, kv_cache=KVCache(kv_type, kv_type, True))
    check(f"target {kv_type}", fp.at_load, fp.total, r)


KV_N_CTX = 2048
KV_ARGS = ["--n-ctx", str(KV_N_CTX), "--outputs", str(K_MAX + 1), "--flash-attn"]


@pytest.mark.parametrize(
    ("family", "kv_type"), [("smollm2", "q8_0"), ("smollm2", "q4_0"), ("gemma3", "q8_0")]
)
@pytest.mark.slow
@pytest.mark.models
def test_kv_cache_type_saves_what_the_model_says(target_path, family, kv_type):
    """What a quantized cache saves against f16, measured on each family (Gemma 3's model
    as a whole is another matter: its sliding-window layers and 262k vocabulary)."""
    from launcher import require_gemma

    from memspec.kv_cache import KVCache

    path = target_path if family == "smollm2" else require_gemma()
    quantized = probe(str(path), *KV_ARGS, "--kv-type-k", kv_type, "--kv-type-v", kv_type)
    f16 = probe(str(path), *KV_ARGS, "--kv-type-k", "f16", "--kv-type-v", "f16")
    saved = (
        target_footprint(path, KV_N_CTX, K_MAX, kv_cache=KVCache("f16", "f16", True)).kv
        - target_footprint(path, KV_N_CTX, K_MAX, kv_cache=KVCache(kv_type, kv_type, True)).kv
    )
    measured = f16["at_load"]["rss"] - quantized["at_load"]["rss"]
    print(
        f"{family} {kv_type}: KV saved, model {saved / 1e6:.1f}, measured {measured / 1e6:.1f} MB"
    )
    assert abs(saved - measured) <= max(TOLERANCE * saved, SLACK_BYTES)


@pytest.mark.slow
def test_a_window_sized_cache_saves_what_the_model_says():
    """Gemma 3's sliding-window layers at 8,192 tokens: a full-size cache (swa_full) against
    the window's (measured: 110 MB apart; the model says 110)."""
    from launcher import require_gemma

    from memspec.kv_cache import KVCache

    path, n_ctx = require_gemma(), 8192
    args = [str(path), "--n-ctx", str(n_ctx), "--outputs", str(K_MAX + 1)]
    window, full = probe(*args), probe(*args, "--swa-full")
    saved = (
        target_footprint(path, n_ctx, K_MAX, kv_cache=KVCache(swa_full=True)).kv
        - target_footprint(path, n_ctx, K_MAX, kv_cache=KVCache()).kv
    )
    measured = full["at_load"]["rss"] - window["at_load"]["rss"]
    print(f"gemma3 window-sized cache at {n_ctx}: saved, model {saved / 1e6:.1f}, "
          f"measured {measured / 1e6:.1f} MB")  # fmt: skip
    assert abs(saved - measured) <= max(TOLERANCE * saved, SLACK_BYTES)
