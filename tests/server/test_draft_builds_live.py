"""Drafts for whatever arrives, on a real daemon: a model of no known family is served at once,
with prompt lookup, while its family is built in the background; its greedy answers are plain
decoding's (token for token `draft: none`'s) before, during and after the build.

The daemon's data dir is the test's own: SmolLM2 135M F32 hard linked in under two names that
no family table knows. `mystery-135m` is the configured target, found in the models dir at
start; its background build is restricted to the cheapest member, the Q4_0 self-draft
(build_drafts_only), a few seconds of quantizing. `broken-135m`'s build fails on purpose: a
file stands where its family's directory goes (the injected fault); it keeps serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from launcher import ROOT, Daemon, running

from memspec.paths import models_dir

pytestmark = pytest.mark.models

SOURCE = "smollm2-135m-f32.gguf"
MYSTERY, BROKEN = "mystery-135m", "broken-135m"
PROMPT = (
    "List the colours again, in the same order: red, green, blue, yellow, red, green, blue, "
    "yellow, red, green,"
)
TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    source = models_dir() / SOURCE
    if not source.is_file():
        pytest.skip(f"{SOURCE} is not in the models dir (scripts/setup.sh)")
    tmp = tmp_path_factory.mktemp("arrivals")
    data = tmp / "data"
    (data / "models").mkdir(parents=True)
    for name in (MYSTERY, BROKEN):
        os.link(source, data / "models" / f"{name}.gguf")
    (data / "families").mkdir()
    (data / "families" / BROKEN).write_text("not a directory: the injected fault\n")
    settings = {
        "target": str(data / "models" / f"{MYSTERY}.gguf"),
        "drafts": None,  # the target's whole pool: its family once built
        "budget": "3GiB",
    }
    env = {
        "MEMSPEC_DATA_DIR": str(data),
        "MEMSPEC_BUILD_DRAFTS": "true",
        "MEMSPEC_BUILD_DRAFTS_ONLY": '["q4_0"]',
        "MEMSPEC_OLLAMA_MODELS": "none",
    }
    with running(tmp, "lookup", settings=settings, env=env) as d:
        yield d


def complete(d: Daemon, model: str, draft: str) -> tuple[str, dict[str, Any]]:
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused")
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"draft": draft},
    )
    return r.choices[0].text, (r.model_extra or {}).get("memspec") or {}


def builds(d: Daemon) -> dict[str, dict[str, Any]]:
    rows = httpx.get(d.url + "/admin/status", timeout=30).json()["draft_builds"]
    return {r["key"]: r for r in rows}


def state(d: Daemon, key: str) -> str | None:
    row = builds(d).get(key)
    return row["state"] if row else None


def wait_for(cond: Callable[[], bool], timeout: float = 240.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def test_answers_stay_plain_decodings_before_during_and_after_the_build(daemon: Daemon) -> None:
    plain, _ = complete(daemon, MYSTERY, "none")
    assert plain
    # Before: served at once, with prompt lookup, while its family is not built.
    before, info = complete(daemon, MYSTERY, "auto")
    # (a quiet machine quantizes 135M in about a second: the build may be done by now)
    assert state(daemon, MYSTERY) in ("queued", "building", "built")
    assert before == plain
    seen: list[str] = []

    def progressed() -> bool:
        s = state(daemon, MYSTERY)
        if not seen or seen[-1] != s:
            seen.append(str(s))
        return s in ("building", "built", "failed")

    wait_for(progressed)
    # During: the build runs in its own process, the answers do not wait for it.
    during, _ = complete(daemon, MYSTERY, "auto")
    assert during == plain
    wait_for(lambda: progressed() and seen[-1] in ("built", "failed"), every=0.2)
    assert seen[-1] == "built", (seen, builds(daemon))
    row = builds(daemon)[MYSTERY]
    assert row["drafts"] == ["q4_0"] and row["reason"] == ""
    assert (Path(row["target"]).parent / f"{MYSTERY}-q4_0.gguf").is_file()
    # After: the family joins the pool at the model's next load.
    ollama.Client(host=daemon.url).generate(model=MYSTERY, prompt="", keep_alive=0)
    wait_for(lambda: not _resident(daemon, MYSTERY), timeout=60, every=0.2)
    after, info = complete(daemon, MYSTERY, "q4_0")
    assert after == plain, info
    auto, _ = complete(daemon, MYSTERY, "auto")
    assert auto == plain
    pool = {
        r["id"]: r for r in httpx.get(daemon.url + "/admin/drafts", timeout=30).json()["drafts"]
    }
    assert pool["q4_0"]["resident"], pool  # preloaded with the family at this load
    shown = ollama.Client(host=daemon.url).show(MYSTERY).model_dump()
    drafts = (shown.get("memspec") or {}).get("drafts") or _raw_show(daemon, MYSTERY)
    assert {"q4_0", "prompt-lookup"} <= set(drafts["drafts"]), drafts
    assert drafts["build"]["state"] == "built"


def _resident(d: Daemon, name: str) -> bool:
    models = httpx.get(d.url + "/admin/status", timeout=30).json()["models"]
    return any(m["name"] == name and m["resident"] for m in models)


def _raw_show(d: Daemon, name: str) -> dict[str, Any]:
    return httpx.post(d.url + "/api/show", json={"model": name}, timeout=30).json()["memspec"][
        "drafts"
    ]


def test_a_failed_build_says_why_and_the_model_keeps_serving(daemon: Daemon) -> None:
    for key in (MYSTERY, BROKEN):  # one build at a time: the target's first
        wait_for(lambda k=key: state(daemon, k) in ("built", "failed"), every=0.2)
    row = builds(daemon)[BROKEN]
    assert row["state"] == "failed"
    assert "File exists" in row["reason"] and BROKEN in row["reason"], row
    plain, _ = complete(daemon, BROKEN, "none")
    answer, _ = complete(daemon, BROKEN, "auto")
    assert answer == plain
    shown = _raw_show(daemon, BROKEN)
    assert shown["build"]["state"] == "failed" and "q4_0" not in shown["drafts"]
    # memspec-ctl status says the same, in words.
    ctl = subprocess.run(
        [sys.executable, "-m", "memspec.ctl", "--url", daemon.url, "status"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ctl.returncode == 0, ctl.stderr
    lines = [ln for ln in ctl.stdout.splitlines() if "drafts build" in ln]
    listed = f"{BROKEN}:latest"  # as the catalog lists a file of no known family
    assert any(f"{listed}: failed: " in ln and "File exists" in ln for ln in lines), ctl.stdout
    assert any(f"{MYSTERY}: built: q4_0" in ln for ln in lines), ctl.stdout
