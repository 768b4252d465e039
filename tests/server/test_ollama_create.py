"""/api/create, /api/blobs/{digest}, /api/copy and `memspec create`, through the official
`ollama` client against a real daemon: SmolLM2's F32 file uploaded as a blob, made a model with
a system prompt and default options, quantized to Q4_K_M by llama.cpp, listed, chatted with,
copied and deleted. The daemon runs on a data dir of its own (the testbed target hard linked
into it), so its store starts empty and nothing it writes reaches the shared data dir.

The helpers' logic (options, names, numbers) is checked first, without models.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from launcher import ADMIN_KEY, API_KEY, ROOT, TARGET_FILE, require_testbed, running

from memspec.errors import InvalidRequest
from memspec.ollama_name import parse
from memspec.ollama_store import (
    CONFIG_MEDIA_TYPE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    Layer,
    Manifest,
    OllamaStore,
)
from memspec.paths import models_dir
from memspec.quantize import file_type
from memspec.server.ollama_create import check_parameters, human_number, manifest_bytes

NAME = "smollm2-made:q4"
LOOSE_FILE = "smollm2-135m-q8_0.gguf"  # a second GGUF in the daemon's models dir
ADOPTED = "adopted:q4_0"  # a model of the adopted Ollama store
ADOPTED_FILE = "smollm2-135m-q4_0.gguf"
UPLOADED_FILE = "smollm2-135m-q2_k.gguf"  # what `memspec create` uploads
SYSTEM = "You are a terse assistant."
PARAMS = {"temperature": 0.0, "num_predict": 8, "stop": ["<|im_end|>"], "num_thread": 1}


# --- logic, no models ------------------------------------------------------------------------


def test_parameters_are_checked_as_chat_options() -> None:
    got = check_parameters({"temperature": 0, "stop": "x", "num_ctx": 512.0, "seed": None})
    assert got == {"temperature": 0, "stop": ["x"], "num_ctx": 512}
    assert check_parameters({"num_gpu": 0}) == {"num_gpu": 0}  # a hardware hint: kept
    for bad in ({"mirostat": 1}, {"typical_p": 0.5}, {"top_k": 1.5}, {"temperature": "hot"},
                {"stop": [1]}, {"num_ctx": 0}, {"temperature": True}):  # fmt: skip
        with pytest.raises(InvalidRequest) as e:
            check_parameters(bad)
        assert e.value.param == f"parameters.{next(iter(bad))}"


def test_numbers_and_manifests_as_ollama_writes_them() -> None:
    assert human_number(134_515_008) == "134.52M"
    assert human_number(1_500_000_000) == "1.5B"
    assert human_number(7_000_000_000) == "7B"
    assert human_number(5_000) == "5K"
    config = Layer("application/vnd.docker.container.image.v1+json", "sha256:" + "a" * 64, 10)
    raw = manifest_bytes(config, [Layer(MEDIA_MODEL, "sha256:" + "b" * 64, 20)])
    assert raw.startswith(b'{"schemaVersion":2,"mediaType":') and raw.endswith(b"}\n")
    assert Manifest.parse(raw).layer(MEDIA_MODEL).size == 20


def test_a_blob_from_another_filesystem_is_copied_and_checked(tmp_path, monkeypatch) -> None:
    """place_file's copy (no hard link across filesystems: the fault injected is os.link's
    EXDEV): the blob is a copy of its own, and a source that does not hash to the digest
    leaves nothing."""
    import errno

    from memspec.ollama_store import BlobMismatch
    from memspec.server import ollama_create

    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(ollama_create.os, "link", no_link)
    store = OllamaStore(tmp_path / "store", writable=True)
    src = tmp_path / "weights.gguf"
    src.write_bytes(b"GGUF" + bytes(4096))
    digest = "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    assert ollama_create.place_file(store, src, digest, "test") == (digest, 4100)
    blob = store.blob_path(digest)
    assert blob.read_bytes() == src.read_bytes() and blob.stat().st_ino != src.stat().st_ino
    wrong = "sha256:" + "3" * 64
    with pytest.raises(BlobMismatch):
        ollama_create.place_file(store, src, wrong, "test")
    assert not store.has_blob(wrong)
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [blob.name]


def test_host_origin_guard_and_a_streamed_blob_past_the_body_limit(tmp_path) -> None:
    """A key-less app (its engine never started: these routes need no model): a foreign Host
    or Origin is a 403 on every route here; a blob larger than `max_body` streams past the
    body limit into the own store; /api/copy wants JSON (a cross-site form cannot send it)."""
    from fastapi.testclient import TestClient

    from memspec import paths
    from memspec.config import Settings
    from memspec.server.app import create_app

    paths.use_data_dir(tmp_path)  # conftest puts the process's data dir back after the test
    client = TestClient(create_app(Settings(host="127.0.0.1")), base_url="http://127.0.0.1:8000")
    data = os.urandom(3 << 20)  # over the default 1 MiB max_body
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    foreign = ({"Host": "evil.example"}, {"Origin": "http://evil.example"})
    for headers in foreign:
        assert client.post("/api/create", json={"model": "x"}, headers=headers).status_code == 403
        assert client.post("/api/copy", json={}, headers=headers).status_code == 403
        r = client.post(f"/api/blobs/{digest}", content=data, headers=headers)
        assert r.status_code == 403
    assert not (tmp_path / "models").exists()
    assert client.post(f"/api/blobs/{digest}", content=data).status_code == 201
    assert client.head(f"/api/blobs/{digest}").status_code == 200
    assert OllamaStore(tmp_path / "models" / "store", writable=False).has_blob(digest)
    form = {"content-type": "text/plain"}
    assert client.post("/api/copy", content=b"{}", headers=form).status_code == 415


# --- against a real daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    require_testbed()
    data = tmp_path_factory.mktemp("create-data")
    (data / "models").mkdir()
    for name in (TARGET_FILE, LOOSE_FILE):
        os.link(models_dir() / name, data / "models" / name)
    return data


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> Path:
    """An Ollama store as Ollama lays it out, with one model (SmolLM2 Q4_0, a system prompt),
    its blob a hard link of the testbed's file (the same filesystem as the daemon's store)."""
    require_testbed()
    root = tmp_path_factory.mktemp("ollama-home") / "models"
    ollama_store = OllamaStore(root, writable=True)  # written here by the test only
    gguf = models_dir() / ADOPTED_FILE
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    ollama_store.blobs_dir.mkdir(parents=True)
    os.link(gguf, ollama_store.blob_path(digest))
    layers = [Layer(MEDIA_MODEL, digest, gguf.stat().st_size)]
    for media_type, data in ((MEDIA_SYSTEM, b"adopted system"), (CONFIG_MEDIA_TYPE, b"{}\n")):
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        ollama_store.blob_path(d).write_bytes(data)
        layers.append(Layer(media_type, d, len(data)))
    ollama_store.write_manifest(parse(ADOPTED), manifest_bytes(layers[-1], layers[:-1]))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, data_dir: Path, adopted: Path) -> Iterator:
    tmp = tmp_path_factory.mktemp("create-daemon")
    env = {"MEMSPEC_DATA_DIR": str(data_dir), "MEMSPEC_OLLAMA_MODELS": str(adopted)}
    with running(tmp, "lookup", keys=True, env=env) as daemon:
        daemon.require_own()
        yield daemon


@pytest.fixture(scope="module")
def store(data_dir: Path) -> OllamaStore:
    return OllamaStore(data_dir / "models" / "store", writable=True)


@pytest.fixture(scope="module")
def admin(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


@pytest.fixture(scope="module")
def user(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def f32_digest(admin: ollama.Client, data_dir: Path) -> str:
    """The target's F32 file, uploaded by the client (POST /api/blobs/<digest>)."""
    return admin.create_blob(data_dir / "models" / TARGET_FILE)


@pytest.fixture(scope="module")
def created(admin: ollama.Client, f32_digest: str) -> list:
    """NAME made from the uploaded blob: SYSTEM, PARAMETERs, LICENSE, quantized to Q4_K_M."""
    return list(
        admin.create(
            NAME,
            files={TARGET_FILE: f32_digest},
            system=SYSTEM,
            parameters=PARAMS,
            license="Apache-2.0",
            quantize="q4_K_M",
            stream=True,
        )
    )


def test_blob_upload_head_and_dedup(admin, http, store, f32_digest) -> None:
    assert store.has_blob(f32_digest)
    assert (
        not store.blob_path(f32_digest)
        .with_name(store.blob_path(f32_digest).name + "-partial")
        .exists()
    )
    assert http.head(f"/api/blobs/{f32_digest}").status_code == 200
    assert http.head("/api/blobs/sha256:" + "0" * 64).status_code == 404
    assert http.head("/api/blobs/sha256:nothex").status_code == 400
    # Already there: 200 at once (the client's second upload of the same file).
    assert http.post(f"/api/blobs/{f32_digest}", content=b"ignored").status_code == 200


def test_a_blob_that_does_not_match_its_digest_leaves_nothing(http, store) -> None:
    data = b"not the bytes the digest names" * 1000
    digest = "sha256:" + hashlib.sha256(b"other").hexdigest()
    r = http.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code == 400
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    assert r.json()["error"].startswith(f'digest mismatch, expected "{digest}"')
    assert got in r.json()["error"]
    blob = store.blob_path(digest)
    assert not blob.exists() and not blob.with_name(blob.name + "-partial").exists()
    leftovers = [p.name for p in store.blobs_dir.iterdir() if "partial" in p.name]
    assert leftovers == []


def test_a_blob_larger_than_the_disk_is_refused_before_it_is_read(server, store) -> None:
    digest = "sha256:" + "1" * 64
    port = int(server.url.rsplit(":", 1)[1])
    # A raw socket: HTTP clients will not declare more bytes than they send.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Length: {1 << 60}\r\n\r\n"
            "x".encode()
        )
        answer = ""
        while not answer.endswith("}") and (chunk := s.recv(65536)):
            answer += chunk.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413") and "free on the models disk" in answer
    assert not store.has_blob(digest)


def test_create_quantizes_with_progress_and_writes_an_ollama_manifest(created, store) -> None:
    statuses = [p.status for p in created]
    assert statuses[-1] == "success" and "writing manifest" in statuses
    quantizing = [p for p in created if p.status == "quantizing F32 model to Q4_K_M"]
    assert len(quantizing) >= 10 and quantizing[-1].completed == quantizing[-1].total
    done = [p.completed for p in quantizing]
    assert done == sorted(done)
    manifest = store.read_manifest(parse(NAME))
    model = manifest.layer(MEDIA_MODEL)
    assert file_type(store.blob_path(model.digest)) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    blob = store.blob_path(model.digest).read_bytes()
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == model.digest == model.digest
    assert store.blob_path(manifest.layer(MEDIA_SYSTEM).digest).read_text() == SYSTEM
    params = json.loads(store.blob_path(manifest.layer(MEDIA_PARAMS).digest).read_bytes())
    assert params == PARAMS
    config = json.loads(store.blob_path(manifest.config.digest).read_bytes())
    assert config["model_format"] == "gguf" and config["model_family"] == "llama"
    assert config["file_type"] == "Q4_K_M" and config["model_type"] == "134.52M"
    # No temp file of the quantizer is left beside the blobs.
    assert not [p for p in store.blobs_dir.iterdir() if p.name.startswith(".")]


def test_the_created_model_is_listed_and_chats(created, user, store) -> None:
    listed = {m.model: m for m in user.list().models}
    assert NAME in listed
    assert listed[NAME].digest == store.read_manifest(parse(NAME)).digest.removeprefix("sha256:")
    assert listed[NAME].details.quantization_level == "Q4_K_M"
    reply = user.chat(NAME, messages=[{"role": "user", "content": "Say hello."}])
    assert reply.message.content.strip()
    assert reply.eval_count <= PARAMS["num_predict"]  # the model's num_predict applied


def test_copy_then_delete(created, admin, user, store) -> None:
    admin.copy(NAME, "copied/smollm2:v1")
    copied = store.read_manifest(parse("copied/smollm2:v1"))
    assert copied.digest == store.read_manifest(parse(NAME)).digest
    assert "copied/smollm2:v1" in {m.model for m in user.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        admin.copy("no-such-model:1", "other:1")
    assert e.value.status_code == 404
    # The copy goes; the original keeps every blob they shared.
    admin.delete("copied/smollm2:v1")
    assert store.read_manifest(parse("copied/smollm2:v1")) is None
    original = store.read_manifest(parse(NAME))
    assert all(store.has_blob(x.digest) for x in (original.config, *original.layers))
    assert "copied/smollm2:v1" not in {m.model for m in user.list().models}


def test_copy_create_and_delete_names_ignore_case_as_ollamas(created, admin, user, store) -> None:
    """Names compare ignoring case on /api/copy, /api/create and /api/delete, as Ollama's
    (routes.go getExistingName): a source is found in any case; a destination or a created
    name that differs from a model's only by case replaces that model under its spelling, so
    no two manifests differ only by case; a delete in any case removes the model."""

    def cased() -> list[str]:
        return sorted(n.full for n in store.names() if n.namespace.lower() == "cased")

    admin.copy(NAME.upper(), "cased/Smol:v1")  # the source, asked in capitals
    original = store.read_manifest(parse(NAME))
    assert store.read_manifest(parse("cased/Smol:v1")).digest == original.digest
    assert cased() == ["registry.ollama.ai/cased/Smol:v1"]
    admin.copy(NAME, "CASED/SMOL:V1")  # onto a case variant: that model, replaced
    assert cased() == ["registry.ollama.ai/cased/Smol:v1"]
    done = admin.create(model="Cased/smol:V1", from_=NAME.upper(), system="Other.")
    assert done.status == "success"
    assert cased() == ["registry.ollama.ai/cased/Smol:v1"]  # replaced, not a second manifest
    made = store.read_manifest(parse("cased/Smol:v1"))
    assert made.digest != original.digest
    system = made.layer(MEDIA_SYSTEM)
    assert store.blob_path(system.digest).read_text() == "Other."
    assert "cased/Smol:v1" in {m.model for m in user.list().models}
    admin.delete("CASED/smol:v1")  # a delete in another case
    assert cased() == []
    with pytest.raises(ollama.ResponseError) as e:
        admin.delete("cased/Smol:v1")
    assert e.value.status_code == 404
    assert store.read_manifest(parse(NAME)).digest == original.digest  # the source untouched
    assert all(store.has_blob(x.digest) for x in (original.config, *original.layers))


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "a" * 5000, "x:y:z/.."])
def test_names_are_checked_as_ollama_checks_them(admin, bad, store) -> None:
    before = sorted(p.as_posix() for p in store.root.rglob("*"))
    with pytest.raises(ollama.ResponseError) as e:
        admin.create(bad, from_=TARGET_FILE)
    assert e.value.status_code == 400 and "invalid model name" in e.value.error
    for source, dest in ((TARGET_FILE, bad), (bad, "fine:1")):
        with pytest.raises(ollama.ResponseError) as e:
            admin.copy(source, dest)
        assert e.value.status_code == 400
    assert sorted(p.as_posix() for p in store.root.rglob("*")) == before


def test_template_adapter_and_unsupported_options_are_refused(admin, f32_digest) -> None:
    cases = [
        ({"template": "{{ .Prompt }}"}, "TEMPLATE is not supported"),
        ({"adapters": {"lora.gguf": f32_digest}}, "ADAPTER is not supported"),
        ({"parameters": {"mirostat": 2}}, "parameters.mirostat is not supported"),
        ({"quantize": "q9_Z"}, "unsupported quantization type q9_Z"),
    ]
    for extra, message in cases:
        with pytest.raises(ollama.ResponseError) as e:
            admin.create("refused:1", from_=TARGET_FILE, **extra)
        assert e.value.status_code == 400 and message in e.value.error, e.value.error


def test_from_a_loose_gguf_and_an_older_clients_modelfile(created, http, store, data_dir) -> None:
    text = f"FROM {NAME}\nSYSTEM be brief\nMESSAGE user hi\nMESSAGE assistant hello\n"
    r = http.post("/api/create", json={"model": "legacy:1", "modelfile": text, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    legacy = store.read_manifest(parse("legacy:1"))
    messages = json.loads(store.blob_path(legacy.layer(MEDIA_MESSAGES).digest).read_bytes())
    assert messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert legacy.layer(MEDIA_MODEL) == store.read_manifest(parse(NAME)).layer(MEDIA_MODEL)
    assert store.blob_path(legacy.layer(MEDIA_SYSTEM).digest).read_text() == "be brief"
    base_params = json.loads(store.blob_path(legacy.layer(MEDIA_PARAMS).digest).read_bytes())
    assert base_params == PARAMS  # carried from the FROM model
    # A path outside the models dir is never read; a FROM nobody knows is a 404.
    for source, status in (("/etc/passwd", 400), ("../../../etc/hostname", 400), ("nope:1", 404)):
        body = {"model": "x:1", "modelfile": f"FROM {source}", "stream": False}
        r = http.post("/api/create", json=body)
        assert r.status_code == status, (source, r.text)
    # A loose GGUF of the models dir, hard linked in (the same inode), not copied.
    r = http.post("/api/create", json={"model": "loose:1", "from": LOOSE_FILE, "stream": False})
    assert r.status_code == 200, r.text
    blob = store.blob_path(store.read_manifest(parse("loose:1")).layer(MEDIA_MODEL).digest)
    assert blob.stat().st_ino == (data_dir / "models" / LOOSE_FILE).stat().st_ino


def test_a_create_whose_client_leaves_still_finishes_whole(created, server, store) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"model": "left:q8", "from": TARGET_FILE, "quantize": "q8_0"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/api/create", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first progress line, then hang up
    deadline = time.monotonic() + 180
    while store.read_manifest(parse("left:q8")) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    made = store.read_manifest(parse("left:q8"))
    assert made is not None, server.logs()
    assert file_type(store.blob_path(made.layer(MEDIA_MODEL).digest)) == 7  # Q8_0
    assert not [p for p in store.blobs_dir.iterdir() if p.name.startswith(".")]


def test_the_admin_key_guards_every_route(server, f32_digest) -> None:
    user_headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=user_headers) as c:
        assert c.post("/api/create", json={"model": "x:1", "from": NAME}).status_code == 401
        assert c.post("/api/copy", json={"source": NAME, "destination": "y"}).status_code == 401
        assert c.head(f"/api/blobs/{f32_digest}").status_code == 401
        assert c.post("/api/blobs/sha256:" + "2" * 64, content=b"x").status_code == 401


def test_memspec_create_cli(created, server, tmp_path, store) -> None:
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {NAME}\nPARAMETER temperature 0.2\nSYSTEM from the CLI\n")
    env = {
        **os.environ,
        "MEMSPEC_URL": server.url,
        "MEMSPEC_ADMIN_KEY": ADMIN_KEY,
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "memspec.cli", "create", "cli:1", "-f", str(modelfile)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cli:1" and "success" in done.stderr
    made = store.read_manifest(parse("cli:1"))
    params = json.loads(store.blob_path(made.layer(MEDIA_PARAMS).digest).read_bytes())
    assert params == {**PARAMS, "temperature": 0.2}
    # A local FROM file is uploaded as a blob first (HEAD, then POST), as `ollama create` does.
    os.link(models_dir() / UPLOADED_FILE, tmp_path / "local.gguf")
    modelfile.write_text("FROM ./local.gguf\nPARAMETER top_k 7\n")
    cmd[cmd.index("cli:1")] = "cli:2"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    made = store.read_manifest(parse("cli:2"))
    digest = "sha256:" + hashlib.sha256((tmp_path / "local.gguf").read_bytes()).hexdigest()
    assert made.layer(MEDIA_MODEL).digest == digest and store.has_blob(digest)
    modelfile.write_text("FROM m\nTEMPLATE x\n")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "TEMPLATE is not supported" in done.stderr


def test_from_and_copy_of_an_adopted_model_never_write_into_its_store(
    server, http, admin, user, store, adopted
) -> None:
    before = _tree_hashes(adopted)
    assert http.head(f"/api/blobs/{_adopted_model(adopted).digest}").status_code == 200
    r = http.post(
        "/api/create",
        json={"model": "mine:1", "from": ADOPTED, "parameters": {"top_k": 5}, "stream": False},
    )
    assert r.status_code == 200, r.text
    admin.copy(ADOPTED, "mine:2")
    layer = _adopted_model(adopted)
    for name in ("mine:1", "mine:2"):
        made = store.read_manifest(parse(name))
        assert made.layer(MEDIA_MODEL) == layer  # the same bytes, in the own store
        assert store.blob_path(layer.digest).stat().st_ino == (
            OllamaStore(adopted, writable=False).blob_path(layer.digest).stat().st_ino
        )  # hard linked: one file on disk
        assert store.blob_path(made.layer(MEDIA_SYSTEM).digest).read_text() == "adopted system"
    assert "hard linked" in server.logs(tail=None)
    reply = user.chat("mine:1", messages=[{"role": "user", "content": "Hi"}], options=PARAMS)
    assert reply.done
    assert _tree_hashes(adopted) == before  # nothing written, nothing removed there


def _adopted_model(root: Path) -> Layer:
    return OllamaStore(root, writable=False).read_manifest(parse(ADOPTED)).layer(MEDIA_MODEL)
