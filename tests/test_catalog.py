"""The model catalog lists only usable files (issue 57): small fake and bad files in a data dir
of the test's own, tiny valid GGUFs written with the `gguf` package. No model is loaded."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from memspec import paths
from memspec.catalog import MAX_REASON, ModelCatalog
from memspec.config import Settings
from memspec.errors import UnusableModelFile

SECRET = b"root:x:0:0:SECRET-CONTENT"  # what a reason must never echo


def tiny_gguf(path: Path, arch: str = "llama", shape: bool = True) -> Path:
    """A valid GGUF of a few hundred bytes: one tensor, and the hyper-parameters every
    listing reads (read_shape) unless `shape` is False."""
    w = gguf.GGUFWriter(str(path), arch)
    if shape:
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_head_count(2)
        w.add_feed_forward_length(16)
        w.add_context_length(32)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def huge_tensor_gguf(path: Path, size: int = 4096) -> Path:
    """Valid magic and version, one F32 tensor of 16384 elements (64 KiB) in a 4 KiB file."""
    name = b"token_embd.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    head += struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 1 << 14, 0, 0)
    path.write_bytes(head.ljust(size, b"\0"))
    return path


def long_key_gguf(path: Path) -> Path:
    """GGUF magic, one key of 10,000 characters with an unknown value type."""
    key = b"K" * 10_000
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(head + struct.pack("<I", 99) + b"\0" * 64)
    return path


@pytest.fixture
def models(tmp_path) -> Path:
    paths.use_data_dir(tmp_path / "data")  # put back after the test (conftest)
    d = tmp_path / "data" / "models"
    d.mkdir(parents=True)
    tiny_gguf(d / "target.gguf")
    return d


def catalog(**settings) -> ModelCatalog:
    return ModelCatalog(Settings.load(target="target.gguf", drafts=[], **settings))


def bad(cat: ModelCatalog) -> dict[str, str]:
    return {b["file"]: b["reason"] for b in cat.bad_models()}


def names(cat: ModelCatalog) -> list[str]:
    return [m.name for m in cat.models()]


def test_every_kind_of_bad_file_is_left_out_with_its_reason(models, tmp_path):
    tiny_gguf(models / "good.gguf")
    (models / "x.gguf").write_bytes(SECRET + os.urandom(4000))
    half = tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    (models / "trunc.gguf").write_bytes(half[: len(half) // 2])
    huge_tensor_gguf(models / "huge.gguf")
    outside = tmp_path / "passwd"
    outside.write_bytes(SECRET)
    (models / "evil.gguf").symlink_to(outside)
    (models / "d.gguf").mkdir()
    (models / "dangling.gguf").symlink_to(models / "gone.gguf")
    tiny_gguf(models / "noshape.gguf", shape=False)
    long_key_gguf(models / "longkey.gguf")
    os.mkfifo(models / "fifo.gguf")  # opening it would block: it must never be opened

    cat = catalog()
    assert names(cat) == ["target", "good:latest"]  # name:tag, as Ollama lists
    reasons = bad(cat)
    assert set(reasons) == {
        "x.gguf", "trunc.gguf", "huge.gguf", "evil.gguf", "d.gguf", "dangling.gguf",
        "noshape.gguf", "longkey.gguf", "fifo.gguf",
    }  # fmt: skip
    assert reasons["x.gguf"] == "no GGUF magic"
    assert "runs past the end of the file" in reasons["trunc.gguf"]
    assert "runs past the end of the file" in reasons["huge.gguf"]
    assert "leaves the models dir" in reasons["evil.gguf"]
    assert reasons["d.gguf"] == "a directory, not a file"
    assert reasons["dangling.gguf"] == "a broken symlink"
    assert "no model shape" in reasons["noshape.gguf"]
    assert reasons["fifo.gguf"] == "not a regular file"
    assert "K" * 81 not in reasons["longkey.gguf"] and "K" * 80 in reasons["longkey.gguf"]
    for reason in reasons.values():
        assert "SECRET" not in reason and "root:" not in reason
        assert len(reason) <= MAX_REASON and reason.isprintable()
    # The rows carry the name each would be served as.
    assert {b["file"]: b["name"] for b in cat.bad_models()}["x.gguf"] == "x"


def test_a_request_naming_a_bad_file_gets_why(models):
    (models / "x.gguf").write_bytes(SECRET)
    cat = catalog()
    for name in ("x", "x.gguf", "x:latest", "x.gguf:latest"):
        err = cat.unusable(name)
        assert isinstance(err, UnusableModelFile), name
        assert err.message == "model file x.gguf is not a usable GGUF: no GGUF magic"
        assert err.param == "model"
        assert cat.find(name) is None
    assert cat.unusable("nothing-here") is None
    assert cat.unusable("target") is None and cat.unusable(None) is None


def test_a_bad_file_never_takes_a_good_ones_name(models):
    # Both files map to Ollama's gemma3:270m; the bad one sorts first.
    (models / "gemma-3-270m-a-bad.gguf").write_bytes(b"junk" * 100)
    tiny_gguf(models / "gemma-3-270m-it.gguf")
    cat = catalog()
    assert names(cat) == ["target", "gemma3:270m"]
    assert cat.find("gemma3:270m").path.name == "gemma-3-270m-it.gguf"
    assert cat.bad_models() == [
        {"file": "gemma-3-270m-a-bad.gguf", "name": "gemma-3-270m-a-bad", "reason": "no GGUF magic"}
    ]
    assert cat.unusable("gemma3:270m") is None  # the name is the good file's


def test_symlinks_inside_are_served_outside_only_when_followed(models, tmp_path):
    (models / "alias.gguf").symlink_to(models / "target.gguf")  # the default itself: skipped
    tiny_gguf(models / "real.gguf")
    (models / "inside.gguf").symlink_to(models / "real.gguf")
    elsewhere = tiny_gguf(tmp_path / "elsewhere.gguf")
    (models / "outside.gguf").symlink_to(elsewhere)
    (tmp_path / "passwd").write_bytes(SECRET)
    (models / "evil.gguf").symlink_to(tmp_path / "passwd")

    cat = catalog()
    assert names(cat) == ["target", "inside:latest", "real:latest"]
    assert set(bad(cat)) == {"outside.gguf", "evil.gguf"}

    followed = catalog(follow_symlinks=True)
    assert names(followed) == ["target", "inside:latest", "outside:latest", "real:latest"]
    assert bad(followed) == {"evil.gguf": "no GGUF magic"}  # read now, and refused


def test_mark_bad_holds_until_the_file_changes(models):
    good = tiny_gguf(models / "good.gguf")
    cat = catalog()
    assert "good:latest" in names(cat) and cat.find("good") is not None
    cat.mark_bad(good, "llama.cpp could not load it:\x00\x1b[31m")
    assert "good" not in names(cat)
    reason = bad(cat)["good.gguf"]
    assert reason.startswith("llama.cpp could not load it:") and reason.isprintable()
    assert "could not load it" in cat.unusable("good").message
    st = good.stat()
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new version
    assert "good:latest" in names(cat) and cat.find("good") is not None and bad(cat) == {}


def test_a_bad_file_replaced_by_a_good_one_is_served(models):
    x = models / "x.gguf"
    x.write_bytes(SECRET)
    cat = catalog()
    assert cat.unusable("x") is not None
    tiny_gguf(models / "x.tmp")
    os.replace(models / "x.tmp", x)
    assert cat.find("x") is not None and cat.unusable("x") is None and bad(cat) == {}


def test_built_drafts_are_neither_models_nor_bad(models):
    (models / "draft.gguf").write_bytes(b"not checked")
    (models / "draft.gguf.build.json").write_text("{}")
    cat = catalog()
    assert names(cat) == ["target"] and bad(cat) == {}


def test_names_compare_ignoring_case_as_ollamas_and_list_as_they_are(models, tmp_path):
    """Ollama finds a model by any casing of its name (server/images.go getExistingName,
    types/model/name.go EqualFold); memspec's lookup does the same for loose files and both
    stores' models, an exact spelling first, and lists every name as it is."""
    from memspec.ollama_store import MEDIA_MODEL
    from tests.test_ollama_store import write_model

    tiny_gguf(models / "smollm2-135m-instruct-q8_0.gguf")  # a loose file: smollm2:135m
    (models / "Broken.gguf").write_bytes(SECRET)
    blob = tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    adopted = tmp_path / "ollama"
    write_model(adopted, "registry.ollama.ai/library/llama3.2/1b", [(MEDIA_MODEL, blob)])
    write_model(adopted, "hf.co/Bartowski/Repo-GGUF/Q4_K_M", [(MEDIA_MODEL, blob)])
    write_model(adopted, "registry.ollama.ai/library/mixed/Tag", [(MEDIA_MODEL, blob)])
    write_model(adopted, "registry.ollama.ai/library/mixed/tag", [(MEDIA_MODEL, blob)])
    cat = catalog(ollama_models=str(adopted))
    listed = names(cat)
    assert listed == [
        "target",
        "smollm2:135m",
        "hf.co/Bartowski/Repo-GGUF:Q4_K_M",
        "llama3.2:1b",
        "mixed:Tag",
        "mixed:tag",
    ]

    def found(name: str) -> str | None:
        model = cat.find(name)
        return model.name if model is not None else None

    assert found("SmolLM2:135M") == "smollm2:135m"
    assert found("SMOLLM2-135M-INSTRUCT-Q8_0.GGUF") == "smollm2:135m"  # its file name
    assert found("LLAMA3.2:1B") == "llama3.2:1b"
    assert found("Registry.Ollama.AI/Library/Llama3.2:1B") == "llama3.2:1b"
    assert found("hf.co/bartowski/repo-gguf:q4_k_m") == "hf.co/Bartowski/Repo-GGUF:Q4_K_M"
    assert found("TARGET") == "target"
    # two names that differ only in case: each answers to its own spelling
    assert found("mixed:Tag") == "mixed:Tag" and found("mixed:tag") == "mixed:tag"
    assert found("smollm2:1350m") is None and found("llama3.2:1") is None
    # a bad file's error answers to any casing too
    error = cat.unusable("BROKEN")
    assert error is not None and "Broken.gguf" in error.message
    assert cat.find("broken") is None
    assert names(cat) == listed  # looking up changed no listed name


def test_the_file_a_served_model_was_made_from_is_not_listed_again(models):
    """The testbed's SmolLM2 target is quantized from the GGUF it fetched: the same weights
    again, which Ollama would not list as a model of its own."""
    tiny_gguf(models / "Source.Q4_1.gguf")
    (models / "target.gguf.build.json").write_text('{"source": "Source.Q4_1.gguf"}')
    tiny_gguf(models / "other.gguf")
    cat = catalog()
    assert names(cat) == ["target", "other:latest"] and bad(cat) == {}
