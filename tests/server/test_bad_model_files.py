"""One bad file must not stop the daemon (issue 57), on the real daemon with the real testbed.

The models dir holds the testbed target and five bad files: random bytes, the first half of the
SmolLM2 Q4_1 GGUF, a header whose tensor runs past the file, a symlink out to /etc/passwd, and
a directory. Listings leave them out and keep the good model, /admin/status says why, a
request naming one gets a 422 that names the file and the reason (never its content), the good
model answers as before, and a bad file replaced by a good GGUF is served.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from launcher import MODEL, ROOT, TARGET_FILE, require_testbed, running

from memspec.package_index import SMOLLM2_FILE
from memspec.paths import cache_dir, models_dir

MARKER = b"SECRET-CONTENT-OF-X"  # in the random file: no answer may echo it
QUESTION = [{"role": "user", "content": "Name three colours."}]
TOKENS = 12

# file -> what its reason says
BAD = {
    "x.gguf": "no GGUF magic",
    "half.gguf": "runs past the end of the file",
    "huge.gguf": "runs past the end of the file",
    "evil.gguf": "leaves the models dir",
    "d.gguf": "a directory",
}


def huge_tensor_gguf(path: Path, size: int = 4096) -> None:
    """Valid magic and version, one F32 tensor of 16384 elements (64 KiB) in a 4 KiB file."""
    name = b"token_embd.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    head += struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 1 << 14, 0, 0)
    path.write_bytes(head.ljust(size, b"\0"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A data dir of the test's own: the target as a symlink to the testbed (the configured
    target may live anywhere), the calibration cache copied (a quick start), the bad files."""
    require_testbed()
    tmp = tmp_path_factory.mktemp("badfiles")
    d = tmp / "data" / "models"
    d.mkdir(parents=True)
    (d / TARGET_FILE).symlink_to(models_dir() / TARGET_FILE)
    if cache_dir().is_dir():
        skip = shutil.ignore_patterns("corpus")
        shutil.copytree(cache_dir(), tmp / "data" / "cache", ignore=skip)
    (d / "x.gguf").write_bytes(MARKER + os.urandom(1 << 16))
    q4 = (models_dir() / SMOLLM2_FILE).read_bytes()
    (d / "half.gguf").write_bytes(q4[: len(q4) // 2])
    huge_tensor_gguf(d / "huge.gguf")
    (d / "evil.gguf").symlink_to("/etc/passwd")
    (d / "d.gguf").mkdir()
    return d


@pytest.fixture(scope="module")
def daemon(models):
    env = {"MEMSPEC_DATA_DIR": str(models.parent)}
    with running(models.parent.parent, "lookup", settings={"parallel": 1}, env=env) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(client) -> str:
    """The good model's greedy answer, asked first: every later answer must equal it."""
    return answer(client, MODEL)


def answer(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0
    )
    assert r.model == model
    return r.choices[0].message.content


def bad_rows(daemon) -> dict[str, dict]:
    st = httpx.get(daemon.url + "/admin/status", timeout=60).json()
    return {b["file"]: b for b in st["bad_models"]}


def assert_no_content(text: str) -> None:
    assert "SECRET" not in text and "root:" not in text and len(text) < 400, text


def test_listings_keep_the_good_model_and_say_why_the_others_are_left_out(daemon, reference):
    assert reference
    tags = httpx.get(daemon.url + "/api/tags", timeout=60)
    assert tags.status_code == 200, tags.text
    assert [m["name"] for m in tags.json()["models"]] == [MODEL]
    ids = [m["id"] for m in httpx.get(daemon.url + "/v1/models", timeout=60).json()["data"]]
    assert ids == [MODEL]
    ps = httpx.get(daemon.url + "/api/ps", timeout=60)
    assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == [MODEL]
    rows = bad_rows(daemon)
    assert set(rows) == set(BAD)
    for file, why in BAD.items():
        assert why in rows[file]["reason"], rows[file]
        assert rows[file]["name"] == file.removesuffix(".gguf")
        assert_no_content(rows[file]["reason"])
    ctl = subprocess.run(
        [sys.executable, "-m", "memspec.ctl", "--url", daemon.url, "status"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert ctl.returncode == 0, ctl.stderr
    assert f"{MODEL} (default)" in ctl.stdout and "x.gguf: no GGUF magic" in ctl.stdout


@pytest.mark.parametrize("file", list(BAD))
def test_a_request_naming_a_bad_file_gets_422_and_the_good_model_still_answers(
    daemon, client, reference, file
):
    name = file.removesuffix(".gguf")
    want = f"model file {file} is not a usable GGUF: "
    for model in (name, file, f"{name}:latest"):
        r = httpx.post(
            daemon.url + "/api/chat",
            json={"model": model, "messages": QUESTION, "stream": False},
            timeout=60,
        )
        assert r.status_code == 422, r.text
        assert set(r.json()) == {"error"}, r.text  # Ollama's shape
        msg = r.json()["error"]
        assert msg.startswith(want) and BAD[file] in msg, msg
        assert_no_content(msg)
    for route in ("/api/generate", "/api/show"):
        body = (
            {"model": name, "prompt": "hi", "stream": False}
            if "generate" in route
            else {"model": name}
        )
        r = httpx.post(daemon.url + route, json=body, timeout=60)
        assert r.status_code == 422 and r.json()["error"].startswith(want), r.text
    with pytest.raises(openai.UnprocessableEntityError) as e:
        answer(client, name)
    err = e.value.body
    assert err["code"] == "model_file_unusable" and err["param"] == "model", err
    assert err["message"].startswith(want) and BAD[file] in err["message"], err
    assert_no_content(json.dumps(err))
    assert answer(client, MODEL) == reference


def test_a_bad_file_replaced_by_a_good_gguf_is_served(daemon, client, models, reference):
    half = models / "half.gguf"
    tmp = models / "half.gguf.part"  # not a candidate while it is written
    shutil.copyfile(models_dir() / SMOLLM2_FILE, tmp)
    os.replace(tmp, half)  # a new size and mtime: checked again
    names = [m["name"] for m in httpx.get(daemon.url + "/api/tags", timeout=60).json()["models"]]
    assert names == [MODEL, "half:latest"]  # name:tag, as Ollama lists; "half" still finds it
    assert "half.gguf" not in bad_rows(daemon)
    assert answer(client, "half:latest")  # the Q4_1 model, loaded beside the target
    assert answer(client, MODEL) == reference
