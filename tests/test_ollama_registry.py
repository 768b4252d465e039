"""Pull and push over the distribution v2 API (memspec.registry) against a real registry.

The registry is Debian's `docker-registry` on loopback (tests/registry.py; skipped, saying so,
where it is not installed). The first tests move small random blobs through memspec.registry
into a temp OllamaStore (no model needed); the last ones run a real daemon and the official
`ollama` client on SmolLM2 (data/models/smollm2-135m-q8_0.gguf): pull, chat, push, pull back.
The one fault injected is a TCP proxy that cuts a connection mid-blob (tests/registry.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memspec import registry
from memspec.ollama_name import parse
from memspec.ollama_store import OllamaStore
from memspec.paths import models_dir
from tests.launcher import ADMIN_KEY, API_KEY, ROOT, TARGET_FILE, require_models, running
from tests.registry import (
    CuttingProxy,
    TokenGate,
    file_digest,
    push_model,
    require_registry,
    running_registry,
)

ollama = pytest.importorskip("ollama")

SMOLLM2 = ROOT / "data" / "models" / "smollm2-135m-q8_0.gguf"
USERS = {"alice": "s3cret-pw"}


def _pull_back(name: str, root: Path) -> OllamaStore:
    """`name` pulled from the test registry into a fresh store at `root`, as USERS' first."""
    fresh = OllamaStore(root, writable=True)
    user, password = next(iter(USERS.items()))
    credentials = registry.Credentials(user, password)
    registry.pull(parse(name), fresh, lambda e: None, insecure=True, credentials=credentials)
    return fresh


# --- no registry needed ---------------------------------------------------------------------


def test_a_bearer_challenge_is_read_as_registries_send_it():
    scheme, params = registry._challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:ns/model:pull,push"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:ns/model:pull,push",
    }
    assert registry._challenge('Basic realm="memspec-test"') == ("basic", {"realm": "memspec-test"})


def test_names_resolve_to_registries_as_ollamas():
    def repo(name: str, insecure: bool = False) -> str:
        return registry.RegistryClient(parse(name), insecure=insecure).repo

    assert repo("smollm2") == "https://registry.ollama.ai/v2/library/smollm2"
    assert repo("me/smollm2:135m") == "https://registry.ollama.ai/v2/me/smollm2"
    assert repo("localhost:5000/ns/m:t", insecure=True) == "http://localhost:5000/v2/ns/m"
    assert repo("hf.co/bartowski/SmolLM2-GGUF:Q4_K_M") == "https://hf.co/v2/bartowski/SmolLM2-GGUF"
    with pytest.raises(registry.PullError, match="insecure protocol http"):
        repo("http://localhost:5000/ns/m:t")  # http only with the insecure flag, as Ollama
    creds = registry.Credentials("alice", "s3cret-pw")
    assert "s3cret" not in repr(creds)


# --- memspec.registry against the real registry, small blobs ------------------------------


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry")) as r:
        yield r


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, reg) -> tuple[Path, object]:
    """A 6 MiB random 'model' pushed as test/small:v1 (the bytes matter, not what they mean)."""
    blob = tmp_path_factory.mktemp("small") / "model.bin"
    blob.write_bytes(os.urandom(6 << 20))
    return blob, push_model(reg, "test/small:v1", blob, params={"temperature": 0.1})


def _store(tmp_path: Path) -> OllamaStore:
    return OllamaStore(tmp_path / "store", writable=True)


def _leftovers(store: OllamaStore) -> list[str]:
    """Whatever a failed pull left: partial blobs, temp manifests, any manifest."""
    found = [p.name for p in (store.root / "blobs").glob("*-partial")]
    found += [str(p) for p in (store.root / "manifests").rglob("*") if p.is_file()]
    return found


def test_pull_stores_the_manifest_and_checked_blobs(reg, small_model, tmp_path):
    blob, pushed = small_model
    store, events = _store(tmp_path), []
    name = parse(f"{reg.host}/test/small:v1")
    manifest = registry.pull(name, store, events.append, insecure=True)
    assert manifest.digest == pushed.manifest_digest  # the bytes the registry sent, kept
    assert store.manifest_path(name).read_bytes() == pushed.manifest
    for digest in pushed.digests:
        assert file_digest(store.blob_path(digest)) == digest
    statuses = [e["status"] for e in events if "digest" not in e]
    assert statuses == [
        "pulling manifest",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    layer_events = [e for e in events if "digest" in e]
    assert {e["digest"] for e in layer_events} == set(pushed.digests)
    assert all(e["status"] == f"pulling {e['digest'][7:19]}" for e in layer_events)
    model = [e for e in layer_events if e["digest"] == pushed.model_digest]
    assert model[-1]["completed"] == model[-1]["total"] == blob.stat().st_size
    # A second pull finds every blob in place and sends only the manifest request.
    events.clear()
    registry.pull(name, store, events.append, insecure=True)
    assert [
        (e["completed"], e["total"]) for e in events if e.get("digest") == pushed.model_digest
    ] == [(blob.stat().st_size, blob.stat().st_size)]


def test_a_connection_cut_mid_blob_resumes_with_range(reg, small_model, tmp_path):
    blob, pushed = small_model
    store = _store(tmp_path)
    with CuttingProxy("127.0.0.1", reg.port, cut_after=2 << 20, cuts=2) as proxy:
        registry.pull(parse(f"{proxy.host}/test/small:v1"), store, lambda e: None, insecure=True)
    assert proxy.cut == 2
    ranges = [
        line.split(":", 1)[1].strip()
        for head in proxy.requests
        for line in head.splitlines()
        if line.lower().startswith("range:")
    ]
    assert ranges and all(r.startswith("bytes=") and r != "bytes=0-" for r in ranges), ranges
    assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
    assert not list((store.root / "blobs").glob("*-partial"))


def test_a_pull_broken_for_good_resumes_on_the_next_pull(reg, small_model, tmp_path):
    blob, pushed = small_model
    store = _store(tmp_path)
    cuts = registry.RETRIES + 1  # every try of this pull is cut
    with CuttingProxy("127.0.0.1", reg.port, cut_after=1 << 20, cuts=cuts) as proxy:
        name = parse(f"{proxy.host}/test/small:v1")
        with pytest.raises(registry.PullError, match="the connection kept breaking"):
            registry.pull(name, store, lambda e: None, insecure=True)
        assert not store.manifest_path(name).exists()
        partial = store.blob_path(pushed.model_digest).with_name(
            store.blob_path(pushed.model_digest).name + "-partial"
        )
        kept = partial.stat().st_size
        assert kept > 0 and not store.has_blob(pushed.model_digest)
        seen = len(proxy.requests)
        registry.pull(name, store, lambda e: None, insecure=True)
        assert f"Range: bytes={kept}-" in "\n".join(proxy.requests[seen:])
    assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()


def test_a_corrupted_blob_is_refused_and_nothing_stays(tmp_path):
    with running_registry(tmp_path / "reg") as r:
        blob = tmp_path / "m.bin"
        blob.write_bytes(os.urandom(3 << 20))
        pushed = push_model(r, "test/bad:v1", blob)
        stored = r.blob_file(pushed.model_digest)
        data = bytearray(stored.read_bytes())
        data[1_000_000] ^= 0xFF  # one flipped byte, same size
        stored.write_bytes(bytes(data))
        store, events = _store(tmp_path), []
        with pytest.raises(registry.PullError, match=registry.DIGEST_MISMATCH) as e:
            registry.pull(parse(f"{r.host}/test/bad:v1"), store, events.append, insecure=True)
        assert pushed.model_digest in e.value.message
        assert not store.has_blob(pushed.model_digest)
        assert _leftovers(store) == []
        assert "success" not in [ev.get("status") for ev in events]


def test_an_unknown_model_is_ollamas_not_found(reg, tmp_path):
    store = _store(tmp_path)
    for name in (f"{reg.host}/test/nosuch:v1", f"{reg.host}/test/small:nosuchtag"):
        with pytest.raises(registry.ModelNotFound) as e:
            registry.pull(parse(name), store, lambda e: None, insecure=True)
        assert e.value.message == "pull model manifest: file does not exist"
    assert _leftovers(store) == []


def test_htpasswd_auth_and_push_then_pull_back_byte_identical(tmp_path):
    with running_registry(tmp_path / "reg", users=USERS) as r:
        blob = tmp_path / "m.bin"
        blob.write_bytes(os.urandom(5 << 20))
        pushed = push_model(r, "test/auth:v1", blob)
        source, name = _store(tmp_path / "a"), parse(f"{r.host}/test/auth:v1")
        with pytest.raises(registry.Unauthorized) as e:
            registry.pull(name, source, lambda e: None, insecure=True)
        assert "s3cret" not in e.value.message
        wrong = registry.Credentials("alice", "wrong")
        with pytest.raises(registry.Unauthorized):
            registry.pull(name, source, lambda e: None, insecure=True, credentials=wrong)
        alice = registry.Credentials(*next(iter(USERS.items())))
        registry.pull(name, source, lambda e: None, insecure=True, credentials=alice)

        # Push it under another repository, then pull that into a fresh store.
        copy = parse(f"{r.host}/other/copy:v2")
        source.write_manifest(copy, pushed.manifest)
        events: list[dict] = []
        registry.push(copy, True, events.append, store=source, credentials=alice)
        statuses = [ev["status"] for ev in events if "digest" not in ev]
        assert statuses == ["retrieving manifest", "pushing manifest", "success"]
        assert {ev["digest"] for ev in events if "digest" in ev} == set(pushed.digests)
        fresh = _store(tmp_path / "b")
        registry.pull(copy, fresh, lambda e: None, insecure=True, credentials=alice)
        assert fresh.manifest_path(copy).read_bytes() == pushed.manifest
        for digest in pushed.digests:
            assert fresh.blob_path(digest).read_bytes() == source.blob_path(digest).read_bytes()
        # A second push finds every blob there (HEAD) and sends none again.
        events.clear()
        registry.push(copy, True, events.append, store=source, credentials=alice)
        assert all(ev["completed"] == ev["total"] for ev in events if "digest" in ev)


def test_bearer_token_auth_from_a_token_server(reg, small_model, tmp_path):
    blob, pushed = small_model
    with TokenGate(reg.url, USERS) as gate:
        name = parse(f"{gate.host}/test/small:v1")
        with pytest.raises(registry.Unauthorized):  # no credentials: no token
            registry.pull(name, _store(tmp_path / "a"), lambda e: None, insecure=True)
        bad = registry.Credentials("alice", "wrong")
        with pytest.raises(registry.Unauthorized):
            registry.pull(
                name, _store(tmp_path / "a"), lambda e: None, insecure=True, credentials=bad
            )
        store = _store(tmp_path / "b")
        alice = registry.Credentials(*next(iter(USERS.items())))
        registry.pull(name, store, lambda e: None, insecure=True, credentials=alice)
    assert gate.tokens_issued == 1  # one token, reused for the manifest and every blob
    assert set(gate.scopes) == {"repository:test/small:pull"}
    assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()


def test_a_blob_redirected_to_another_host_gets_no_registry_token(reg, small_model, tmp_path):
    """A registry that sends its blobs to another host (a CDN, S3: a signed URL) is followed,
    and the registry's token is not sent there (a presigned URL refuses a second auth, and
    the token is not that host's to see)."""
    blob, pushed = small_model
    alice = registry.Credentials(*next(iter(USERS.items())))
    with CuttingProxy("127.0.0.1", reg.port, cut_after=1 << 40, cuts=0) as cdn:
        with TokenGate(reg.url, USERS, blobs_at=f"http://{cdn.host}") as gate:
            store = _store(tmp_path)
            name = parse(f"{gate.host}/test/small:v1")
            registry.pull(name, store, lambda e: None, insecure=True, credentials=alice)
    assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
    fetched = [h for h in cdn.requests if h.startswith("GET /v2/test/small/blobs/")]
    assert len(fetched) == len(pushed.digests), cdn.requests  # every blob, from the "CDN"
    assert not any("authorization:" in h.lower() for h in fetched), fetched


def test_push_with_bearer_token_auth_then_pull_back_byte_identical(reg, small_model, tmp_path):
    """A push through a token-auth front (the realm's token per scope, as Docker Hub and the
    Ollama library ask): a pull token does not let it write, a `pull,push` one does; then a
    pull of what was pushed, into a fresh store, is byte for byte the source."""
    blob, pushed = small_model
    alice = registry.Credentials(*next(iter(USERS.items())))
    with TokenGate(reg.url, USERS) as gate:
        source = _store(tmp_path / "a")
        registry.pull(
            parse(f"{gate.host}/test/small:v1"), source, lambda e: None, insecure=True,
            credentials=alice,
        )  # fmt: skip
        dest = parse(f"{gate.host}/pushed/tok:v1")
        source.write_manifest(dest, pushed.manifest)
        with pytest.raises(registry.Unauthorized) as e:  # no credentials: no token to write
            registry.push(dest, True, lambda e: None, store=source)
        assert "s3cret" not in e.value.message and gate.writes == []
        events: list[dict] = []
        registry.push(dest, True, events.append, store=source, credentials=alice)
        assert [ev["status"] for ev in events if "digest" not in ev] == [
            "retrieving manifest",
            "pushing manifest",
            "success",
        ]
        assert "repository:pushed/tok:pull,push" in gate.scopes
        # Every byte went through the gate with a push token: the upload sessions, their
        # bodies, the commits and the manifest.
        assert {w.split()[0] for w in gate.writes} == {"POST", "PATCH", "PUT"}, gate.writes
        assert "PUT /v2/pushed/tok/manifests/v1" in gate.writes
        fresh = _store(tmp_path / "b")
        registry.pull(dest, fresh, lambda e: None, insecure=True, credentials=alice)
    assert fresh.manifest_path(dest).read_bytes() == pushed.manifest
    for digest in pushed.digests:
        assert fresh.blob_path(digest).read_bytes() == source.blob_path(digest).read_bytes()
    assert fresh.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
    # The registry behind the gate holds what was pushed, under its name.
    r = httpx.get(
        f"{reg.url}/v2/pushed/tok/manifests/v1",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 200 and r.content == pushed.manifest


def test_two_pulls_sharing_a_blob_at_once_both_succeed(reg, small_model, tmp_path):
    blob, pushed = small_model
    push_model(reg, "test/small:v2", blob)  # the same model blob under a second tag
    store, errors = _store(tmp_path), []

    def one(tag: str) -> None:
        try:
            registry.pull(
                parse(f"{reg.host}/test/small:{tag}"), store, lambda e: None, insecure=True
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(t,)) for t in ("v1", "v2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert file_digest(store.blob_path(pushed.model_digest)) == pushed.model_digest


def _memspec(
    *args: str, data: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    full |= {"MEMSPEC_DATA_DIR": str(data), "PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "memspec.cli", *args],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_pull_push_and_rm(reg, small_model, tmp_path):
    blob, pushed = small_model
    data = tmp_path / "data"
    name = f"{reg.host}/test/small:v1"
    bad = _memspec("pull", "--insecure", f"{reg.host}/test/nosuch:v1", data=data)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        "memspec: error: pull model manifest: file does not exist"
    )
    done = _memspec("pull", "--insecure", name, data=data)
    assert done.returncode == 0, done.stderr[-3000:]
    store = OllamaStore(data / "models" / "store", writable=True)
    assert done.stdout.strip() == str(store.manifest_path(parse(name)))
    assert f"pulling {pushed.model_digest[7:19]}" in done.stderr and "success" in done.stderr
    assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
    sent = _memspec("push", "--insecure", name, data=data)
    assert sent.returncode == 0 and "pushing manifest" in sent.stderr, sent.stderr[-2000:]
    gone = _memspec("rm", f"{reg.host}/TEST/Small:V1", data=data)  # case as stored: ignored
    assert gone.returncode == 0, gone.stderr
    assert not store.manifest_path(parse(name)).exists() and not store.has_blob(pushed.model_digest)
    again = _memspec("rm", name, data=data)
    assert again.returncode == 1
    assert again.stderr.strip() == f"memspec: error: model '{name}' not found"


# --- a real daemon and the official ollama client on SmolLM2 ------------------------------


@pytest.fixture(scope="module")
def smollm2_registry(tmp_path_factory):
    require_models()
    require_registry()
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2.name} missing: run scripts/setup.sh")
    with running_registry(tmp_path_factory.mktemp("smolreg"), users=USERS) as r:
        pushed = push_model(r, "test/smollm2:q8", SMOLLM2, params={"stop": ["<|im_end|>"]})
        yield r, pushed


@pytest.fixture(scope="module")
def daemon_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pulled")


@pytest.fixture(scope="module")
def daemon(smollm2_registry, daemon_data, tmp_path_factory):
    """A daemon on the testbed target with the admin key set, pulling into a temp data dir,
    with the registry's credentials in its environment."""
    user, password = next(iter(USERS.items()))
    with running(
        tmp_path_factory.mktemp("serve"),
        "lookup",
        settings={"target": str(models_dir() / TARGET_FILE)},
        env={
            "MEMSPEC_DATA_DIR": str(daemon_data),
            "MEMSPEC_REGISTRY_USERNAME": user,
            "MEMSPEC_REGISTRY_PASSWORD": password,
        },
        keys=True,
    ) as d:
        yield d


def _client(daemon, key: str = ADMIN_KEY) -> object:
    return ollama.Client(host=daemon.url, headers={"Authorization": f"Bearer {key}"})


def _store_of(data: Path) -> OllamaStore:
    return OllamaStore(data / "models" / "store", writable=True)


def test_ollama_client_pulls_through_memspec_and_chats(smollm2_registry, daemon, daemon_data):
    reg, pushed = smollm2_registry
    client = _client(daemon)
    with CuttingProxy("127.0.0.1", reg.port, cut_after=40 << 20) as proxy:
        name = f"{proxy.host}/test/smollm2:q8"
        progress = list(client.pull(name, insecure=True, stream=True))
    assert proxy.cut == 1  # the connection was cut mid-blob, and the pull resumed
    assert any("range: bytes=" in h.lower() for h in proxy.requests)
    statuses = [p.status for p in progress if not p.digest]
    assert statuses == [
        "pulling manifest",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    model_events = [p for p in progress if p.digest == pushed.model_digest]
    done = [p.completed or 0 for p in model_events]
    assert done[-1] == SMOLLM2.stat().st_size and len(set(done)) > 2
    store = _store_of(daemon_data)
    manifest = store.read_manifest(parse(name))
    assert manifest is not None and manifest.raw == pushed.manifest
    for layer in (manifest.config, *manifest.layers):  # the stored files are the digests
        assert file_digest(store.blob_path(layer.digest)) == layer.digest
    assert not list((store.root / "blobs").glob("*-partial"))
    # Servable as soon as its manifest is written: listed, and it chats.
    user = _client(daemon, API_KEY)
    listed = {m.model for m in user.list().models}
    short = f"{proxy.host}/test/smollm2:q8"
    assert short in listed, listed
    reply = user.chat(
        model=short,
        messages=[{"role": "user", "content": "Say hi."}],
        options={"num_predict": 4, "temperature": 0},
    )
    assert reply.message.content.strip()


def test_ollama_client_sees_ollamas_errors(smollm2_registry, daemon, daemon_data):
    reg, _ = smollm2_registry
    client = _client(daemon)
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull(f"{reg.host}/test/nosuch:v1", insecure=True, stream=True))
    assert e.value.error == "pull model manifest: file does not exist"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(f"{reg.host}/test/nosuch:v1", insecure=True)
    assert (e.value.error, e.value.status_code) == (registry.NOT_FOUND, 500)
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(f"{reg.host}/test/smollm2:q8")  # https to an http registry
    assert e.value.status_code == 500 and e.value.error.startswith("pull model manifest")
    with pytest.raises(ollama.ResponseError) as e:  # a chat client's key is not the admin key
        ollama.Client(host=daemon.url).pull(f"{reg.host}/test/smollm2:q8", insecure=True)
    assert e.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as e:
        client.push(f"{reg.host}/test/never-pulled:v1", insecure=True)
    assert e.value.status_code == 404


def test_push_and_pull_keep_the_admin_guard_and_the_credentials_secret(smollm2_registry, daemon):
    reg, _ = smollm2_registry
    name = f"{reg.host}/test/smollm2:q8"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        for route in ("/api/pull", "/api/push"):
            r = http.post(route, json={"model": name, "insecure": True})  # no key
            assert r.status_code == 401, (route, r.text)
            r = http.post(route, headers={"Authorization": f"Bearer {API_KEY}"}, json={})
            assert r.status_code == 401 and "admin key" in r.json()["error"], (route, r.text)
            r = http.post(route, headers=admin | {"Content-Type": "text/plain"}, content="{}")
            assert r.status_code == 415, (route, r.text)
        # The body's credentials (Ollama's older fields) are used, and never echoed back.
        r = http.post(
            "/api/pull",
            headers=admin,
            json={
                "model": name,
                "insecure": True,
                "stream": False,
                "username": "alice",
                "password": "not-the-password",
            },
        )
        assert r.status_code == 500 and "unauthorized" in r.json()["error"], r.text
        assert "not-the-password" not in r.text
    assert "not-the-password" not in daemon.logs(tail=None)


def test_a_client_that_leaves_mid_pull_stops_it_and_the_next_pull_resumes(
    daemon, daemon_data, tmp_path
):
    with running_registry(tmp_path / "reg", users=USERS) as r:
        blob = tmp_path / "m.bin"
        blob.write_bytes(os.urandom(8 << 20))
        pushed = push_model(r, "test/leave:v1", blob)
        store = _store_of(daemon_data)
        partial = store.blob_path(pushed.model_digest).with_name(
            store.blob_path(pushed.model_digest).name + "-partial"
        )
        with CuttingProxy("127.0.0.1", r.port, cut_after=1 << 40, cuts=0, pause_s=0.01) as proxy:
            name = f"{proxy.host}/test/leave:v1"
            body = {"model": name, "insecure": True}
            headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
            with httpx.stream(
                "POST", f"{daemon.url}/api/pull", json=body, headers=headers, timeout=60
            ) as resp:
                for line in resp.iter_lines():
                    event = json.loads(line)
                    if event.get("digest") == pushed.model_digest and event.get("completed"):
                        break  # the model blob is on its way: hang up
            deadline = time.monotonic() + 30
            while True:  # the pull stops at its next buffer; the partial stops growing
                size = partial.stat().st_size if partial.exists() else -1
                time.sleep(0.5)
                now = partial.stat().st_size if partial.exists() else -1
                if now == size or time.monotonic() > deadline:
                    break
            assert 0 < now < blob.stat().st_size, now
            assert store.read_manifest(parse(name)) is None  # nothing listed half-pulled
            seen = len(proxy.requests)
            done = _client(daemon).pull(name, insecure=True)
            assert done.status == "success"
            assert "Range: bytes=" in "\n".join(proxy.requests[seen:])
        assert store.blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
        assert not partial.exists()


def test_two_clients_pulling_one_name_share_one_download(daemon, daemon_data, tmp_path):
    with running_registry(tmp_path / "reg", users=USERS) as r:
        blob = tmp_path / "m.bin"
        blob.write_bytes(os.urandom(8 << 20))
        pushed = push_model(r, "test/shared:v1", blob)
        with CuttingProxy("127.0.0.1", r.port, cut_after=1 << 40, cuts=0, pause_s=0.01) as proxy:
            name = f"{proxy.host}/test/shared:v1"
            results: list[list] = []

            def one() -> None:
                results.append(list(_client(daemon).pull(name, insecure=True, stream=True)))

            threads = [threading.Thread(target=one) for _ in range(2)]
            for t in threads:
                t.start()
                time.sleep(0.3)  # the second joins the first mid-download
            for t in threads:
                t.join(120)
        assert [p[-1].status for p in results] == ["success", "success"]
        # The second saw the first's progress from its start (the same events), not a pull
        # of its own that found the blob in place.
        assert [e.model_dump() for e in results[0]] == [e.model_dump() for e in results[1]]
        assert len([e for e in results[1] if e.digest == pushed.model_digest]) > 2
        gets = [
            h
            for h in proxy.requests
            if h.startswith(f"GET /v2/test/shared/blobs/{pushed.model_digest}")
        ]
        assert len(gets) == 1, gets  # one download, two clients
        assert (
            _store_of(daemon_data).blob_path(pushed.model_digest).read_bytes() == blob.read_bytes()
        )


def test_a_corrupted_blob_through_the_daemon_leaves_nothing(daemon, daemon_data, tmp_path):
    with running_registry(tmp_path / "reg", users=USERS) as r:
        blob = tmp_path / "m.bin"
        blob.write_bytes(os.urandom(4 << 20))
        pushed = push_model(r, "test/corrupt:v1", blob)
        stored = r.blob_file(pushed.model_digest)
        stored.write_bytes(b"\0" * stored.stat().st_size)
        with pytest.raises(ollama.ResponseError) as e:
            list(_client(daemon).pull(f"{r.host}/test/corrupt:v1", insecure=True, stream=True))
        assert registry.DIGEST_MISMATCH in e.value.error
    store = _store_of(daemon_data)
    assert not store.has_blob(pushed.model_digest)
    assert not list((store.root / "blobs").glob("*-partial"))
    assert store.read_manifest(parse(f"{r.host}/test/corrupt:v1")) is None


def test_push_then_pull_back_byte_identical_then_delete(
    smollm2_registry, daemon, daemon_data, tmp_path
):
    reg, pushed = smollm2_registry
    client = _client(daemon)
    src = f"{reg.host}/test/smollm2:q8"
    client.pull(src, insecure=True)
    # Copy the manifest under a new name (what /api/copy does), push it, pull it back.
    store = _store_of(daemon_data)
    dest = f"{reg.host}/pushed/smollm2:v1"
    store.write_manifest(parse(dest), pushed.manifest)
    progress = list(client.push(dest, insecure=True, stream=True))
    statuses = [p.status for p in progress if not p.digest]
    assert statuses == ["retrieving manifest", "pushing manifest", "success"]
    fresh = _pull_back(dest, tmp_path / "fresh")
    assert fresh.manifest_path(parse(dest)).read_bytes() == pushed.manifest
    assert fresh.blob_path(pushed.model_digest).read_bytes() == SMOLLM2.read_bytes()
    # Delete: the copy goes, the blobs the source still uses stay.
    assert client.delete(dest).status == "success"
    assert store.read_manifest(parse(dest)) is None and store.has_blob(pushed.model_digest)
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(dest)
    assert e.value.status_code == 404


def test_api_push_of_a_created_model_with_token_auth_then_pull_back(
    smollm2_registry, daemon, daemon_data, tmp_path
):
    """/api/push of a model made by /api/create, to a registry behind Bearer token auth (the
    daemon's credentials from its environment): then a pull of it, into a fresh store, is the
    daemon's manifest and blobs byte for byte. The name is asked in another case than it is
    stored in: it is the stored model, pushed under its own spelling, as Ollama's."""
    reg, _ = smollm2_registry
    client = _client(daemon)
    src = f"{reg.host}/test/smollm2:q8"
    client.pull(src, insecure=True)
    with running_registry(tmp_path / "reg") as plain, TokenGate(plain.url, USERS) as gate:
        made = f"{gate.host}/made/smollm2:tok"
        done = client.create(
            model=made, from_=src, system="You are terse.", parameters={"temperature": 0.2}
        )
        assert done.status == "success"
        store = _store_of(daemon_data)
        manifest = store.read_manifest(parse(made))
        assert manifest is not None and len(manifest.layers) >= 3  # model, system, params
        # Asked in another case: the stored model, pushed under its spelling (as Ollama's).
        asked = f"{gate.host}/Made/SmolLM2:TOK"
        progress = list(client.push(asked, insecure=True, stream=True))
        assert [p.status for p in progress if not p.digest] == [
            "retrieving manifest",
            "pushing manifest",
            "success",
        ]
        assert "repository:made/smollm2:pull,push" in gate.scopes
        assert "PUT /v2/made/smollm2/manifests/tok" in gate.writes
        fresh = _pull_back(made, tmp_path / "fresh")
    assert fresh.manifest_path(parse(made)).read_bytes() == manifest.raw
    for layer in (manifest.config, *manifest.layers):
        assert file_digest(fresh.blob_path(layer.digest)) == layer.digest
        assert (
            fresh.blob_path(layer.digest).read_bytes() == store.blob_path(layer.digest).read_bytes()
        )
    client.delete(f"{gate.host}/MADE/smollm2:Tok")  # a delete in another case, too
    assert store.read_manifest(parse(made)) is None


def test_delete_refuses_the_model_being_served(smollm2_registry, daemon, daemon_data):
    reg, pushed = smollm2_registry
    client = _client(daemon)
    name = f"{reg.host}/test/smollm2:q8"
    client.pull(name, insecure=True)
    user = _client(daemon, API_KEY)
    user.generate(model=name, prompt="hi", options={"num_predict": 1}, keep_alive=-1)
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(name)
    assert e.value.status_code == 400 and "in use by this daemon" in e.value.error
    assert _store_of(daemon_data).has_blob(pushed.model_digest)
    user.generate(model=name, prompt="", keep_alive=0)  # unloaded: now it may go
    deadline = time.monotonic() + 30
    while True:
        try:
            client.delete(name)
            break
        except ollama.ResponseError as err:
            if "in use" not in err.error or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert _store_of(daemon_data).read_manifest(parse(name)) is None
    assert name not in {m.model for m in user.list().models}


# --- the benchmark (not a test): `python -m tests.test_ollama_registry [--out PATH]` ---------


def bench(tmp: Path, rounds: int = 5) -> dict:
    """Pull throughput of the SmolLM2 blob through memspec.registry vs curl of the same blob
    from the same registry, interleaved (curl, ours, curl, ours, ...), and this process's RSS
    during each pull (sampled every 20 ms): a blob streams, so it stays flat. The headline
    ratio is best against best; each round's own ratio shows the spread on a busy machine.
    curl writes to the page cache only; a pull also fsyncs the blob before its rename."""
    import platform
    import resource

    import psutil

    def cpu(who: int) -> float:
        u = resource.getrusage(who)
        return u.ru_utime + u.ru_stime

    proc = psutil.Process()
    with running_registry(tmp / "reg") as r:
        pushed = push_model(r, "test/smollm2:q8", SMOLLM2)
        url = f"{r.url}/v2/test/smollm2/blobs/{pushed.model_digest}"
        size = SMOLLM2.stat().st_size
        curl_s: list[float] = []
        ours_s: list[float] = []
        rss_mb: list[list[float]] = []  # per pull: RSS samples, MB
        curl_cpu: list[float] = []  # CPU seconds (user + system): steadier than wall time
        ours_cpu: list[float] = []  # on a shared machine
        for i in range(rounds):
            out = tmp / f"curl{i}.bin"
            c, t = cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
            subprocess.run(["curl", "-sS", "-o", str(out), url], check=True)
            curl_s.append(time.perf_counter() - t)
            curl_cpu.append(cpu(resource.RUSAGE_CHILDREN) - c)
            out.unlink()
            samples: list[float] = [proc.memory_info().rss / 1e6]
            done = threading.Event()

            def sample(samples: list[float] = samples, done: threading.Event = done) -> None:
                while not done.wait(0.02):
                    samples.append(proc.memory_info().rss / 1e6)

            sampler = threading.Thread(target=sample)
            sampler.start()
            store = _store(tmp / f"s{i}")
            c, t = cpu(resource.RUSAGE_SELF), time.perf_counter()
            registry.pull(parse(f"{r.host}/test/smollm2:q8"), store, lambda e: None, insecure=True)
            ours_s.append(time.perf_counter() - t)
            ours_cpu.append(cpu(resource.RUSAGE_SELF) - c)
            done.set()
            sampler.join()
            samples.append(proc.memory_info().rss / 1e6)
            rss_mb.append([round(x, 2) for x in samples])
            subprocess.run(["rm", "-rf", str(tmp / f"s{i}")], check=True)
    per_round = [c / o for c, o in zip(curl_s, ours_s, strict=True)]
    return {
        "what": "pull of one blob from a loopback docker-registry: memspec.registry.pull "
        "(SHA-256 checked, fsync, rename) vs curl -o of the same URL, interleaved",
        "command": ".venv/bin/python -m tests.test_ollama_registry --out PATH",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "blob_MB": round(size / 1e6, 3),
        "rounds": rounds,
        "curl_MBps": round(size / min(curl_s) / 1e6, 1),
        "memspec_MBps": round(size / min(ours_s) / 1e6, 1),
        "ratio": round(min(curl_s) / min(ours_s), 3),
        "ratio_per_round": [round(x, 3) for x in per_round],
        "ratio_min_max": [round(min(per_round), 3), round(max(per_round), 3)],
        "curl_MBps_per_round": [round(size / x / 1e6, 1) for x in curl_s],
        "memspec_MBps_per_round": [round(size / x / 1e6, 1) for x in ours_s],
        "curl_cpu_s_per_round": [round(x, 3) for x in curl_cpu],
        "memspec_cpu_s_per_round": [round(x, 3) for x in ours_cpu],
        "rss_growth_MB": round(max(max(s) - s[0] for s in rss_mb), 2),
        "rss_samples_MB": rss_mb,
    }


def first_token(tmp: Path) -> dict:
    """Issue 53's goal: from "pull done" to the first token of a model no cache knows, against
    that model's load time (its drafts build in the background; calibration waits for idle)."""
    import re

    with running_registry(tmp / "reg") as r:
        push_model(r, "test/fresh:q8", SMOLLM2)
        (tmp / "serve").mkdir()
        settings = {"target": str(models_dir() / TARGET_FILE)}
        env = {"MEMSPEC_DATA_DIR": str(tmp / "data"), "MEMSPEC_BUILD_DRAFTS": "true"}
        with running(tmp / "serve", "lookup", settings=settings, env=env, keys=True) as d:
            admin = ollama.Client(host=d.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            user = ollama.Client(host=d.url, headers={"Authorization": f"Bearer {API_KEY}"})
            name = f"{r.host}/test/fresh:q8"
            t0 = time.perf_counter()
            list(admin.pull(name, insecure=True, stream=True))
            pulled = time.perf_counter()
            first = None
            chat = [{"role": "user", "content": "Say hi."}]
            options = {"temperature": 0, "num_predict": 8}
            for chunk in user.chat(model=name, messages=chat, options=options, stream=True):
                if first is None and chunk.message.content:
                    first = time.perf_counter()
            loads = re.findall(r"model (\S+) loaded in ([0-9.]+) s", d.logs(None))
    assert first is not None
    return {
        "what": "pull done -> first token of a model no cache knows, vs its load",
        "command": ".venv/bin/python -m tests.test_ollama_registry --first-token --out PATH",
        "pull_s": round(pulled - t0, 3),
        "pull_done_to_first_token_s": round(first - pulled, 3),
        "load_s": [float(s) for n, s in loads if n == name],
    }


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="pull throughput vs curl (see bench())")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--first-token", action="store_true", help="first_token() instead")
    ap.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = first_token(Path(tmp)) if args.first_token else bench(Path(tmp), args.rounds)
    text = json.dumps(report, indent=1)
    summary = {k: v for k, v in report.items() if k != "rss_samples_MB"}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(text + "\n")
