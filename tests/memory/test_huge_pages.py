"""The `memspec` command starts itself again with malloc asking for huge pages, once, and only
where that does something; a GLIBC_TUNABLES that names the tunable is the operator's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memspec.memory import huge_pages
from memspec.memory.huge_pages import REEXEC_MARK, TUNABLE, huge_page_env


@pytest.fixture
def linux_madvise(monkeypatch):
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))


def test_the_tunable_is_added_to_what_is_there(linux_madvise):
    env = huge_page_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"{TUNABLE}=1", REEXEC_MARK: "1"}
    other = huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other is not None
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


@pytest.mark.parametrize(
    "env",
    [
        {REEXEC_MARK: "1"},  # already started again: never a loop
        {"GLIBC_TUNABLES": f"{TUNABLE}=0"},  # the operator turned it off
        {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=1"},
    ],
)
def test_nothing_to_do_when_told_or_done(linux_madvise, env):
    assert huge_page_env(env) is None


@pytest.mark.parametrize(
    "platform,mode,glibc",
    [("darwin", "madvise", (2, 36)), ("linux", "never", (2, 36)), ("linux", "always", (2, 36)),
     ("linux", None, (2, 36)), ("linux", "madvise", (2, 31)), ("linux", "madvise", None)],
)  # fmt: skip
def test_nothing_to_do_where_it_changes_nothing(monkeypatch, platform, mode, glibc):
    monkeypatch.setattr(huge_pages.sys, "platform", platform)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: mode)
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: glibc)
    assert huge_page_env({}) is None


@pytest.mark.models
def test_a_load_under_the_tunable_lands_on_huge_pages(tmp_path):
    """The thing that matters, in a process started as the command starts itself: SmolLM2's
    weights (~540 MB F32) are on transparent huge pages after the load."""
    env = huge_page_env(dict(os.environ))
    if env is None:
        pytest.skip("no THP madvise mode with glibc 2.35+ here, or the tunable already set")
    code = (
        "from memspec.backends.base import BackendOptions\n"
        "from memspec.backends.llama_cpp import LlamaCppBackend\n"
        "from memspec.memory.huge_pages import huge_page_bytes\n"
        "from memspec.paths import resolve_model_path\n"
        "b = LlamaCppBackend(resolve_model_path('smollm2-135m-f32.gguf'), BackendOptions())\n"
        "print(huge_page_bytes())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) >= 64 << 20  # ~540 MB of weights: most land on them
