"""Draft ids and file names from requests, the admin API and memspec-ctl never reach outside
the configured model directories. Canary files sit next to the models directory and in the
test's temp dir; inotify reports any open or read of them by anyone, so a traversal that got
as far as touching a file would show even if the daemon then answered with an error.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from launcher import MODEL, ROOT
from reliability_harness import OpenWatch, assert_openai_error, status

from memspec.drafts.manifest import ManifestError, check_file_name, load_manifest

pytestmark = pytest.mark.timeout(300)


def hostile_ids(hardened) -> list[str]:
    data: Path = hardened.data
    return [
        "..",
        ".",
        "../canary",
        "../canary.gguf",
        "../../canary.toml",
        "q4_0/../../canary",
        "a/b",
        "/etc/passwd",
        str(data / "canary.gguf"),
        "..\\canary",
        "%2e%2e%2fcanary",
        "..%2Fcanary.gguf",
        "%252e%252e%252fcanary",
        "q4_0\x00",
        "q4_0%00",
        "~",
        "~root/.ssh/id_rsa",
        "${HOME}",
        "C:\\Windows\\win.ini",
        "\uff0e\uff0e\uff0fcanary",  # full-width "../"
        "q4_0 ",
        "a" * 5000,
        "file:///etc/passwd",
    ]


@pytest.fixture(scope="module")
def watch(hardened):
    w = OpenWatch(hardened.canaries)
    yield w
    w.close()


@pytest.fixture(scope="module")
def drafts_before(hardened) -> list[dict]:
    return [
        {k: d[k] for k in ("id", "resident", "pinned")}
        for d in status(hardened.url, hardened.admin)["drafts"]
    ]


def assert_untouched(hardened, watch, drafts_before) -> None:
    opened = watch.events()
    assert not opened, f"canaries opened: {opened}"
    now = [
        {k: d[k] for k in ("id", "resident", "pinned")}
        for d in status(hardened.url, hardened.admin)["drafts"]
    ]
    assert now == drafts_before  # no new draft appeared, nothing was loaded


def test_canaries_are_watched(hardened, watch):
    """The watch itself works: reading a canary here is seen."""
    hardened.canaries[0].read_text()
    assert set(watch.events()) == {hardened.canaries[0]}  # IN_OPEN, IN_ACCESS


def test_draft_field_of_completions(hardened, watch, drafts_before):
    for draft in hostile_ids(hardened):
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            ),
        ):
            for stream in (False, True):
                r = httpx.post(
                    hardened.url + path,
                    json=body | {"draft": draft, "stream": stream},
                    headers=hardened.api,
                    timeout=60,
                )
                err = assert_openai_error(r, (400, 404))
                assert err["param"] == "draft", (draft, err)
    assert_untouched(hardened, watch, drafts_before)


@pytest.mark.parametrize("action", ["load", "pin", "evict", "unpin"])
def test_admin_draft_routes(hardened, watch, drafts_before, action):
    for draft in hostile_ids(hardened):
        # Encoded (one path segment), and as written: slashes and dots may change the route.
        for segment in {quote(draft, safe=""), quote(draft, safe="/\\~$:")}:
            r = httpx.post(
                f"{hardened.url}/admin/drafts/{segment}/{action}",
                json={},
                headers=hardened.admin,
                timeout=60,
            )
            assert_openai_error(r, (400, 404, 405))
    assert_untouched(hardened, watch, drafts_before)


def test_model_field_and_model_route(hardened, watch, drafts_before):
    for name in hostile_ids(hardened)[:12]:
        r = httpx.post(
            hardened.url + "/v1/completions",
            json={"model": name, "prompt": "Hi", "max_tokens": 2},
            headers=hardened.api,
            timeout=60,
        )
        assert_openai_error(r, (400, 404))
        if name in (".", ".."):
            continue  # the client resolves dot segments: that is GET /v1/models, the list
        r = httpx.get(
            f"{hardened.url}/v1/models/{quote(name, safe='')}", headers=hardened.api, timeout=60
        )
        assert_openai_error(r, (400, 404))
    assert_untouched(hardened, watch, drafts_before)


def test_ctl_draft_commands(hardened, watch, drafts_before):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MEMSPEC_ADMIN_KEY": "x"}
    for draft in ("../canary", "/etc/passwd", "..", str(hardened.data / "canary.gguf")):
        for action in ("load", "pin"):
            p = subprocess.run(
                [sys.executable, "-m", "memspec.ctl", "--url", hardened.url, "--key"]
                + [hardened.admin["Authorization"][7:], "drafts", action, draft],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
                cwd=ROOT,
            )
            assert p.returncode == 1, (draft, p.stdout, p.stderr)
            assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert_untouched(hardened, watch, drafts_before)


def test_manifest_file_names_stay_in_the_models_directory(tmp_path):
    """A manifest (the only place a draft's file is named) cannot point outside models/."""
    for name in ("../canary.gguf", "/etc/passwd", "sub/x.gguf", "..", ".", ""):
        with pytest.raises(ValueError):
            check_file_name(name)
        m = tmp_path / "evil.toml"
        m.write_text(f'id = "evil"\nkind = "model"\nfile = "{name}"\n')
        with pytest.raises(ManifestError):
            load_manifest(m)
    for bad_id in ("../x", "a/b", "..", "/etc/passwd"):
        m = tmp_path / "evil.toml"
        m.write_text(f'id = "{bad_id}"\nkind = "prompt_lookup"\n')
        with pytest.raises(ManifestError):
            load_manifest(m)
