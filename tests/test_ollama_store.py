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
    existing_name,
    own_store,
)


def write_blob(root: Path, data: bytes) -> dict[str, object]:
    """One layer as Ollama's NewLayer leaves it: the bytes under their digest's name."""
    hexd = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{hexd}"
    if not blob.exists():  # a blob the test linked in place stays as it is
        blob.write_bytes(data)
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


def test_names_ignore_case_as_ollamas_get_existing_name(ollama_root: Path, tmp_path: Path) -> None:
    """OllamaStore.existing_name: Ollama's getExistingName (server/routes.go), which create,
    copy, delete, pull and push call: a name that differs from a stored one only by case is
    that one, in its spelling; a new name takes the spelling of the parts already there."""
    store = OllamaStore(ollama_root, writable=False)

    def spelled(name: str) -> str:
        return store.existing_name(parse(name)).full

    assert spelled("llama3.2:1b") == "registry.ollama.ai/library/llama3.2:1b"  # exact
    assert spelled("LLAMA3.2:1B") == "registry.ollama.ai/library/llama3.2:1b"
    assert spelled("Registry.Ollama.AI/Library/Llama3.2:1b") == (
        "registry.ollama.ai/library/llama3.2:1b"
    )
    assert spelled("HF.co/U/R:q4_k_m") == "hf.co/u/r:Q4_K_M"
    assert spelled("MyHost:5000/NS/Name:TAG") == "myhost:5000/ns/name:tag"
    # No such model: each part as some manifest spells it, the rest as given.
    assert spelled("hf.co/U/Other:Q4_K_m") == "hf.co/u/Other:Q4_K_M"
    assert spelled("Brand-New:V1") == "registry.ollama.ai/library/Brand-New:V1"
    assert store.existing_name(parse("LLAMA3.2:1B")).explicit_tag
    # Two stores: the first that has the model spells it; else the first spells the parts.
    own = OllamaStore(tmp_path / "own", writable=True)
    write_model(own.root, "registry.ollama.ai/library/Mine/v1", [(MEDIA_MODEL, b"GGUF-c")])
    assert existing_name(parse("llama3.2:1B"), own, store).full == (
        "registry.ollama.ai/library/llama3.2:1b"
    )
    assert existing_name(parse("mine:V1"), own, store).full == "registry.ollama.ai/library/Mine:v1"
    assert existing_name(parse("MINE:v2"), own, store).full == "registry.ollama.ai/library/Mine:v2"
    # An exact spelling wins over a case variant beside it.
    write_model(own.root, "registry.ollama.ai/library/mine/v1", [(MEDIA_MODEL, b"GGUF-d")])
    assert own.existing_name(parse("mine:v1")).model == "mine"
    assert own.existing_name(parse("Mine:v1")).model == "Mine"


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


def test_blob_writer_threads_keep_the_order_and_report_a_failed_write(tmp_path: Path) -> None:
    """write() hands buffers (bytes, or a stream's reads as a tuple) to a hash thread and a
    file thread: the blob is the bytes in the order given, and an error of the file thread
    (a full disk) is raised by commit, which then renames nothing."""
    store = OllamaStore(tmp_path, writable=True)
    parts = [os.urandom(70_000 + i) for i in range(40)]  # more buffers than the queues hold
    data = b"".join(parts)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    w = store.open_blob_writer(digest)
    for i in range(0, 40, 4):
        w.write(tuple(parts[i : i + 4]) if i % 8 else b"".join(parts[i : i + 4]))
    assert w.written == len(data)
    assert w.commit().read_bytes() == data

    other = b"y" * 5000
    digest = "sha256:" + hashlib.sha256(other).hexdigest()
    w = store.open_blob_writer(digest)

    def full_disk(parts: tuple[bytes, ...]) -> None:
        raise OSError(28, "No space left on device")

    w._write_parts = full_disk  # type: ignore[method-assign]  # the file thread's step
    w.write(other)
    with pytest.raises(OSError, match="No space left"):
        w.commit()
    assert not store.has_blob(digest)


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
    monkeypatch.delenv("MEMSPEC_OLLAMA_MODELS", raising=False)  # (conftest: none)
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


# --- the catalog over the stores (tiny GGUFs, nothing loaded) ---------------------------------


@pytest.fixture
def data(tmp_path: Path) -> Path:
    from memspec import paths
    from tests.test_catalog import tiny_gguf

    paths.use_data_dir(tmp_path / "data")  # put back after the test (conftest)
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    tiny_gguf(models / "target.gguf")
    tiny_gguf(tmp_path / "tiny.gguf")
    return tmp_path


def store_catalog(data: Path, **settings: object):  # -> ModelCatalog
    from memspec.catalog import ModelCatalog

    settings.setdefault("ollama_models", str(data / "ollama"))
    return ModelCatalog(Settings.load(target="target.gguf", drafts=[], **settings))


def test_catalog_serves_both_stores_under_ollamas_names(data: Path) -> None:
    gguf = (data / "tiny.gguf").read_bytes()
    adopted = data / "ollama"
    params = json.dumps({"stop": ["<end>"], "temperature": 0}).encode()
    raw = write_model(
        adopted,
        "registry.ollama.ai/library/llama3.2/1b",
        [(MEDIA_MODEL, gguf), (MEDIA_PARAMS, params), (MEDIA_SYSTEM, b"Be brief."),
         ("application/vnd.ollama.image.license", b"MIT"),
         ("application/vnd.ollama.image.template", b"{{ .Prompt }}")],
    )  # fmt: skip
    write_model(adopted, "hf.co/u/r/Q4_K_M", [(MEDIA_MODEL, gguf)])
    write_model(adopted, "myhost:5000/ns/name/tag", [(MEDIA_MODEL, gguf)])
    write_model(
        adopted,
        "registry.ollama.ai/library/llava/7b",
        [(MEDIA_MODEL, gguf), ("application/vnd.ollama.image.projector", b"proj")],
    )
    # memspec's own store: its llama3.2:1b wins over the adopted one's
    own = data / "data" / "models" / "store"
    own_raw = write_model(own, "registry.ollama.ai/library/llama3.2/1b", [(MEDIA_MODEL, gguf)])
    write_model(own, "registry.ollama.ai/library/mine/latest", [(MEDIA_MODEL, gguf)])
    cat = store_catalog(data)
    listed = {m.name: m for m in cat.models()}
    assert set(listed) == {
        "target",
        "llama3.2:1b",
        "mine:latest",
        "hf.co/u/r:Q4_K_M",
        "myhost:5000/ns/name:tag",
        "llava:7b",
    }
    assert cat.models()[0].name == "target"
    mine = listed["llama3.2:1b"]
    assert mine.store is not None and not mine.store.adopted
    assert mine.store.digest == "sha256:" + hashlib.sha256(own_raw).hexdigest()
    # served in place: the path is the blob's
    assert mine.path.parent == own / "blobs"
    assert cat.find("mine") == listed["mine:latest"]
    assert cat.find("registry.ollama.ai/library/mine:latest") == listed["mine:latest"]
    hf = cat.find("hf.co/u/r:Q4_K_M")
    assert hf is not None and hf.path.parent == adopted / "blobs"
    # the projector: listed, refused with the layer named, in bad_models with the reason
    assert listed["llava:7b"].refused and ".projector" in listed["llava:7b"].refused
    assert cat.find("llava:7b") is None
    assert cat.find("llava:7b", refused=True) == listed["llava:7b"]
    error = cat.unusable("llava:7b")
    assert error is not None and ".projector" in error.message
    assert any(b["name"] == "llava:7b" and "projector" in b["reason"] for b in cat.bad_models())
    # with the own store's copy gone, the adopted one's layers are read
    (own / "manifests/registry.ollama.ai/library/llama3.2/1b").unlink()
    adopted_model = cat.find("llama3.2:1b")
    assert adopted_model is not None and adopted_model.store is not None
    entry = adopted_model.store
    assert entry.adopted and entry.digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert entry.options == {"stop": ["<end>"], "temperature": 0}
    assert entry.system == "Be brief." and entry.license == ("MIT",)
    assert entry.template == "{{ .Prompt }}" and any("not executed" in n for n in entry.notes)


def test_loose_files_keep_working_beside_a_store(data: Path) -> None:
    from tests.test_catalog import tiny_gguf

    tiny_gguf(data / "data" / "models" / "smollm2-135m-instruct-q8_0.gguf")
    gguf = (data / "tiny.gguf").read_bytes()
    write_model(data / "ollama", "registry.ollama.ai/library/other/1b", [(MEDIA_MODEL, gguf)])
    cat = store_catalog(data)
    assert [m.name for m in cat.models()] == ["target", "smollm2:135m", "other:1b"]
    # the same name in a store: the store's model takes it, the file is served by its stem
    # (listed name:tag, as Ollama lists; the bare stem still finds it)
    write_model(data / "ollama", "registry.ollama.ai/library/smollm2/135m", [(MEDIA_MODEL, gguf)])
    names = [m.name for m in cat.models()]
    assert "smollm2:135m" in names and "smollm2-135m-instruct-q8_0:latest" in names
    assert cat.find("smollm2-135m-instruct-q8_0") is not None
    found = cat.find("smollm2:135m")
    assert found is not None and found.store is not None
    assert store_catalog(data, ollama_models="none").find("other:1b") is None


def test_bad_store_models_are_bad_models_not_crashes(data: Path) -> None:
    gguf = (data / "tiny.gguf").read_bytes()
    adopted = data / "ollama"
    write_model(adopted, "registry.ollama.ai/library/notgguf/1b", [(MEDIA_MODEL, b"x" * 4000)])
    write_model(adopted, "registry.ollama.ai/library/noblob/1b", [(MEDIA_MODEL, b"lost")])
    (adopted / "blobs" / ("sha256-" + hashlib.sha256(b"lost").hexdigest())).unlink()
    write_model(adopted, "registry.ollama.ai/library/nomodel/1b", [(MEDIA_SYSTEM, b"hi")])
    write_model(
        adopted, "registry.ollama.ai/library/badparams/1b",
        [(MEDIA_MODEL, gguf), (MEDIA_PARAMS, b"[1, 2")],
    )  # fmt: skip
    write_model(
        adopted, "registry.ollama.ai/library/adapter/1b",
        [(MEDIA_MODEL, gguf), ("application/vnd.ollama.image.adapter", b"lora")],
    )  # fmt: skip
    write_model(
        adopted, "registry.ollama.ai/library/future/1b",
        [(MEDIA_MODEL, gguf), ("application/vnd.ollama.image.hologram", b"?")],
    )  # fmt: skip
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    write_model(
        adopted, "registry.ollama.ai/library/withmsgs/1b",
        [(MEDIA_MODEL, gguf), ("application/vnd.ollama.image.messages",
                               json.dumps(messages).encode())],
    )  # fmt: skip
    torn = adopted / "manifests/registry.ollama.ai/library/torn/1b"
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b'{"schemaVersion": 2, "layers": [')
    cat = store_catalog(data)
    reasons = {b["name"]: b["reason"] for b in cat.bad_models()}
    assert "not a valid GGUF" in reasons["notgguf:1b"] or "magic" in reasons["notgguf:1b"]
    assert "missing" in reasons["noblob:1b"]
    assert "no model" in reasons["nomodel:1b"]
    assert "not JSON" in reasons["badparams:1b"]
    assert "manifest" in reasons["torn:1b"]
    assert ".adapter" in reasons["adapter:1b"] and ".hologram" in reasons["future:1b"]
    listed = {m.name for m in cat.models()}
    assert listed == {"target", "adapter:1b", "future:1b", "withmsgs:1b"}
    withmsgs = cat.find("withmsgs:1b")
    assert withmsgs is not None and withmsgs.store is not None
    assert withmsgs.store.messages == tuple(messages)
    for name in ("notgguf:1b", "noblob:1b", "torn:1b", "adapter:1b"):
        assert cat.find(name) is None and cat.unusable(name) is not None


def test_a_second_writer_of_a_blob_waits_then_resumes(tmp_path: Path) -> None:
    import threading

    store = OllamaStore(tmp_path, writable=True)
    data = os.urandom(50_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    first = store.open_blob_writer(digest)
    first.write(data[:20_000])
    got: list[int] = []
    second = threading.Thread(target=lambda: got.append(store.open_blob_writer(digest).offset))
    second.start()
    second.join(0.3)
    assert second.is_alive() and not got  # it waits: no two writers append to one partial
    first.abort()  # the first breaks off: the second resumes from what it left
    second.join(10)
    assert got == [20_000]


def test_a_manifest_write_that_fails_leaves_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    raw = write_model(src, "registry.ollama.ai/library/m/t", [(MEDIA_MODEL, b"GGUF")])
    store = OllamaStore(tmp_path / "own", writable=True)
    name = parse("m:t")
    store.write_manifest(name, raw)

    def power_cut(*args: object) -> None:  # the fault injected: the rename never happens
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", power_cut)
    with pytest.raises(OSError):
        store.write_manifest(name, raw.rstrip(b"\n"))
    assert store.manifest_path(name).read_bytes() == raw
    assert [p.name for p in store.manifest_path(name).parent.iterdir()] == ["t"]


def test_a_store_model_named_as_the_target_is_shown_as_shadowed(data: Path) -> None:
    gguf = (data / "tiny.gguf").read_bytes()
    write_model(data / "ollama", "registry.ollama.ai/library/llama3.2/1b", [(MEDIA_MODEL, gguf)])
    cat = store_catalog(data, model_name="llama3.2:1b")
    (only,) = cat.models()
    assert only.default and only.store is None  # the configured target keeps its name
    reasons = {b["name"]: b["reason"] for b in cat.bad_models()}
    assert "configured target" in reasons["llama3.2:1b"]
