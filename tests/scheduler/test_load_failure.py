"""A missing or corrupt draft file: the draft is marked failed with the reason, nothing stays
half-loaded, and the runtime keeps decoding (with another draft or none), output exact.

The models directory is a temporary copy (MEMSPEC_DATA_DIR): q8_0 intact, q4_0 missing, q2_k
garbage. A second case corrupts an intact file after its footprint was read, so the failure
comes from llama.cpp's loader itself, on the loader thread.
"""

from __future__ import annotations

import os
import shutil

import pytest

from memspec.config import Settings
from memspec.engine.sampling import SamplingParams
from memspec.errors import ModelLoadError
from memspec.paths import models_dir
from memspec.runtime import Runtime

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

TARGET_FILE = "smollm2-135m-f32.gguf"
PROMPT = "Extract the names from this sentence: Alice met Bob and Carol at the station."


@pytest.fixture()
def broken_pool(tmp_path, monkeypatch):
    real = models_dir()
    if not (real / TARGET_FILE).is_file():
        pytest.fail(f"testbed missing in {real}: run scripts/setup.sh", pytrace=False)
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(real / "smollm2-135m-q8_0.gguf", models / "smollm2-135m-q8_0.gguf")
    shutil.copyfile(real / "smollm2-135m-q2_k.gguf", models / "smollm2-135m-q2_k.gguf")
    with open(models / "smollm2-135m-q2_k.gguf", "r+b") as f:  # header kept, body garbage
        f.seek(64)
        f.write(bytes(range(256)) * 16)
        f.truncate(8192)
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path))
    return real, models


def make_runtime(real, drafts: list[str]) -> Runtime:
    s = Settings.load(
        target=str(real / TARGET_FILE), drafts=drafts, n_ctx=512, budget="4GiB", n_threads=1
    )
    return Runtime(s, calibrate_costs=False)


def test_missing_and_corrupt_drafts_leave_runtime_decoding(broken_pool):
    real, models = broken_pool
    rt = make_runtime(real, ["prompt-lookup", "q8_0", "q4_0", "q2_k"])
    try:
        rows = {r["id"]: r for r in rt.draft_admin.draft_status()}
        assert rows["q4_0"]["state"] == "failed" and "not found" in rows["q4_0"]["error"]
        assert rows["q2_k"]["state"] == "failed" and rows["q2_k"]["error"]
        assert rows["q8_0"]["state"] == "resident"
        assert rows["prompt-lookup"]["state"] == "resident"
        ws = rt.working_set
        assert ws.load_failures == 2
        # Nothing half-loaded: only the resident drafts are charged.
        assert ws.used_bytes() == ws.reserved_bytes + rows["q8_0"]["bytes"]

        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPT}])
        params = SamplingParams(max_tokens=16)
        ref = rt.generate(prompt, params, draft="none").token_ids
        auto = rt.generate(prompt, params, draft="auto")
        assert auto.token_ids == ref
        assert set(auto.drafts_used) <= {"q8_0", "prompt-lookup"} and auto.drafts_used
        for failed in ("q4_0", "q2_k"):  # named explicitly: decodes without it, exact
            gen = rt.generate(prompt, params, draft=failed)
            assert gen.token_ids == ref and not gen.drafts_used
        assert ws.acquire("q4_0") is None  # no retry per request; status says why
        with pytest.raises(ModelLoadError):
            rt.draft_admin.load_draft("q2_k")  # an explicit load retries, and reports the reason
        # Fixed on disk: the explicit load now succeeds.
        shutil.copyfile(real / "smollm2-135m-q4_0.gguf", models / "smollm2-135m-q4_0.gguf")
        rt.draft_admin.load_draft("q4_0")
        assert rt.generate(prompt, params, draft="q4_0").token_ids == ref
        assert {r["id"]: r["state"] for r in rt.draft_admin.draft_status()}["q4_0"] == "resident"
    finally:
        rt.close()


def test_corrupted_after_start_fails_in_llama_cpp(broken_pool):
    real, models = broken_pool
    shutil.copyfile(real / "smollm2-135m-q4_0.gguf", models / "smollm2-135m-q4_0.gguf")
    rt = make_runtime(real, ["prompt-lookup"])
    try:
        ws = rt.working_set
        assert rt.draft_admin.draft_bytes("q4_0") > 0  # footprint read from the intact header
        ws.prefetch([("q4_0", 1.0)])
        ws.wait_idle(timeout=60)
        rt.draft_admin.evict_draft("q4_0")
        # Now the tensor data is cut short: only llama.cpp's loader can notice.
        path = models / "smollm2-135m-q4_0.gguf"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        used = ws.used_bytes()
        assert ws.acquire("q4_0") is None
        row = {r["id"]: r for r in rt.draft_admin.draft_status()}["q4_0"]
        assert row["state"] == "failed" and "failed to load" in row["error"]
        assert ws.used_bytes() == used  # the failed load released its reservation
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPT}])
        params = SamplingParams(max_tokens=12)
        ref = rt.generate(prompt, params, draft="none").token_ids
        assert rt.generate(prompt, params, draft="auto").token_ids == ref
    finally:
        rt.close()
