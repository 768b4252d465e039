"""memspec.ollama_store against a store laid out as Ollama's source writes it (no models).

Ollama (manifest/manifest.go WriteManifest, manifest/layer.go NewLayer) writes each layer to
`blobs/sha256-<hex>` and the manifest, JSON-encoded with a trailing newline, to
`manifests/<host>/<namespace>/<model>/<tag>`; the digest it lists is the manifest file's
SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from memspec.config import Settings
from memspec.errors import InvalidRequest
from memspec.ollama_name import parse
from memspec.ollama_store import (
    CONFIG_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    BlobMismatch,
    Manifest,
    OllamaStore,
    StoreReadOnly,
    adopted_store,
    own_store,
)


def write_blob(root: Path, data: bytes) -> dict[str, object]:
    """One layer as Ollama's NewLayer leaves it: the bytes under their digest's name."""
    hexd = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{hexd}").write_bytes(data)
    return {"digest": f"sha256:{hexd}", "size": len(data)}


def write_model(root: Path, filepath: str, layers: list[tuple[str, bytes]]) -> bytes:
    """A manifest as Ollama's WriteManifest encodes it (Go's json.Encoder: compact, one
    trailing newline), over blobs written first; returns the manifest's bytes."""
    config = write_blob(root, json.dumps({"model_format": "gguf"}).encode())
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, **config},
        "layers": [{"mediaType": mt, **write_blob(root, data)} for mt, data in layers],
    }
    raw = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    path = root / "manifests" / filepath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return raw


@pytest.fixture
def ollama_root(tmp_path: Path) -> Path:
    root = tmp_path / "ollama"
    write_model(
        root,
        "registry.ollama.ai/library/llama3.2/1b",
        [(MEDIA_MODEL, b"GGUF-a"), (MEDIA_PARAMS, b'{"stop":["x"]}'), (MEDIA_SYSTEM, b"hi")],
    )
    write_model(root, "hf.co/u/r/Q4_K_M", [(MEDIA_MODEL, b"GGUF-b")])
    write_model(root, "myhost:5000/ns/name/tag", [(MEDIA_MODEL, b"GGUF-a")])
    return root


def test_names_and_layers_of_ollamas_layout(ollama_root: Path) -> None:
    store = OllamaStore(ollama_root, writable=False)
    names = {n.display for n in store.names()}
    assert names == {"llama3.2:1b", "hf.co/u/r:Q4_K_M", "myhost:5000/ns/name:tag"}
    m = store.read_manifest(parse("llama3.2:1b"))
    assert m is not None
    raw = (ollama_root / "manifests/registry.ollama.ai/library/llama3.2/1b").read_bytes()
    assert m.digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert m.raw == raw
    model = m.layer(MEDIA_MODEL)
    assert model is not None and model.size == len(b"GGUF-a")
    assert store.blob_path(model.digest).read_bytes() == b"GGUF-a"
    assert store.has_blob(model.digest)
    assert m.layer("application/vnd.ollama.image.adapter") is None
    assert store.read_manifest(parse("nothere:latest")) is None


def test_stray_files_are_skipped(ollama_root: Path) -> None:
    (ollama_root / "manifests" / "readme").write_text("x")
    (ollama_root / "manifests/registry.ollama.ai/library/llama3.2/.tmp").write_text("x")
    (ollama_root / "manifests/a/b/c/d").mkdir(parents=True)  # a directory, not a manifest
    store = OllamaStore(ollama_root, writable=False)
    assert len(store.names()) == 3


def test_digest_checked_before_any_path(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path, writable=True)
    good = "sha256:" + "a" * 64
    assert store.blob_path(good) == tmp_path / "blobs" / ("sha256-" + "a" * 64)
    for bad in ("sha256:../../etc/passwd", "sha256:" + "A" * 64, "md5:" + "a" * 32, ""):
        with pytest.raises(InvalidRequest):
            store.blob_path(bad)


def test_manifest_parse_refuses_what_is_not_one() -> None:
    for raw in (b"not json", b"[]", b'{"schemaVersion":1,"layers":[]}', b'{"schemaVersion":2}'):
        with pytest.raises(InvalidRequest):
            Manifest.parse(raw)
    bad_layer = {
        "schemaVersion": 2,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": "sha256:" + "0" * 64, "size": 1},
        "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:../x", "size": 1}],
    }
    with pytest.raises(InvalidRequest, match="digest"):
        Manifest.parse(json.dumps(bad_layer).encode())


def test_blob_writer_resumes_and_checks(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path, writable=True)
    data = os.urandom(300_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with store.open_blob_writer(digest) as w:
        assert w.offset == 0
        w.write(data[:100_000])
    # the break: the partial stays, no blob under the digest's name
    assert not store.has_blob(digest)
    w = store.open_blob_writer(digest)
    assert w.offset == 100_000
    w.write(data[100_000:])
    path = w.commit()
    assert path == store.blob_path(digest) and path.read_bytes() == data
    assert not path.with_name(path.name + "-partial").exists()


def test_blob_mismatch_deletes_the_partial(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path, writable=True)
    digest = "sha256:" + hashlib.sha256(b"right").hexdigest()
    w = store.open_blob_writer(digest)
    w.write(b"wrong")
    with pytest.raises(BlobMismatch):
        w.commit()
    assert not store.has_blob(digest)
    assert list((tmp_path / "blobs").iterdir()) == []


def test_manifest_write_is_atomic_and_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "src"
    raw = write_model(src, "registry.ollama.ai/library/m/t", [(MEDIA_MODEL, b"GGUF")])
    store = OllamaStore(tmp_path / "own", writable=True)
    name = parse("m:t")
    m = store.write_manifest(name, raw)
    assert store.manifest_path(name).read_bytes() == raw
    assert store.read_manifest(name) == m
    # a second write replaces it whole, and leaves no temp file beside it
    m2 = store.write_manifest(name, raw.rstrip(b"\n"))
    assert store.read_manifest(name) == m2 and m2.digest != m.digest
    assert [p.name for p in store.manifest_path(name).parent.iterdir()] == ["t"]
    # a bad manifest is refused before anything is written
    with pytest.raises(InvalidRequest):
        store.write_manifest(parse("other:t"), b"{}")
    assert not store.manifest_path(parse("other:t")).exists()


def test_delete_keeps_shared_blobs(ollama_root: Path) -> None:
    store = OllamaStore(ollama_root, writable=True)
    shared = store.read_manifest(parse("llama3.2:1b"))
    assert shared is not None
    model = shared.layer(MEDIA_MODEL)
    params = shared.layer(MEDIA_PARAMS)
    assert model is not None and params is not None
    removed = store.delete(parse("llama3.2:1b"))
    assert removed[0] == ollama_root / "manifests/registry.ollama.ai/library/llama3.2/1b"
    assert store.has_blob(model.digest)  # myhost:5000/ns/name:tag uses the same GGUF
    assert not store.has_blob(params.digest)
    assert store.blob_path(params.digest) in removed
    assert not (ollama_root / "manifests/registry.ollama.ai/library/llama3.2").exists()
    assert store.delete(parse("llama3.2:1b")) == []


def test_adopted_store_is_read_only(ollama_root: Path) -> None:
    before = sorted((p, p.read_bytes()) for p in ollama_root.rglob("*") if p.is_file())
    store = adopted_store(Settings(ollama_models=str(ollama_root)))
    assert store is not None and not store.writable
    name = parse("llama3.2:1b")
    with pytest.raises(StoreReadOnly):
        store.delete(name)
    with pytest.raises(StoreReadOnly):
        store.write_manifest(name, b"{}")
    with pytest.raises(StoreReadOnly):
        store.open_blob_writer("sha256:" + "a" * 64)
    after = sorted((p, p.read_bytes()) for p in ollama_root.rglob("*") if p.is_file())
    assert before == after


def test_where_the_adopted_store_is_found(
    ollama_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert adopted_store(Settings(ollama_models="none")) is None
    assert adopted_store(Settings(ollama_models=str(tmp_path / "absent"))) is None
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_root))
    found = adopted_store(Settings())
    assert found is not None and found.root == ollama_root
    assert adopted_store(Settings(ollama_models="none")) is None
    monkeypatch.setenv("OLLAMA_MODELS", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    home_store = tmp_path / ".ollama" / "models"
    home_store.mkdir(parents=True)
    found = adopted_store(Settings())
    assert found is not None and found.root == home_store


def test_own_store_is_writable_under_the_models_dir(tmp_path: Path) -> None:
    from memspec import paths

    paths.use_data_dir(tmp_path)
    try:
        store = own_store()
        assert store.writable and store.root == tmp_path / "models" / "store"
    finally:
        paths.use_data_dir(None)
