"""The README's "Your own target and drafts" walkthrough, run as a user runs it.

Every line of the section's ```sh blocks is run in order with .venv/bin on PATH, against the
real data dir (Gemma 3 270M, its family already built by setup: `drafts build` is then a
quick "up to date"). The `memspec serve` line is started through tests/launcher with the flags
it shows (on a free port), and the section's ```python block (the openai client) is run
against it with only its base_url pointed there. Each command's flags are also checked against
its own --help, so the README cannot show a flag that does not exist.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from launcher import GEMMA_DRAFTS, ROOT, require_gemma, running

pytestmark = pytest.mark.slow  # scripts/test.sh --all

SECTION = "## Your own target and drafts"
README_URL = "http://127.0.0.1:8000"  # where the README's client expects `memspec serve`
GEMMA_MODEL = "gemma3:270m"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section(), flags=re.M | re.S)


def commands() -> list[str]:
    """The sh blocks' commands, one per line (a trailing backslash continues a line)."""
    out = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def argv(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def subcommand(command: str) -> str:
    """'drafts build' for `memspec drafts build --target X`: the words before the first flag."""
    words = []
    for word in argv(command)[1:]:
        if word.startswith("-"):
            break
        words.append(word)
    return " ".join(words)


def user_env(tmp: Path) -> dict[str, str]:
    """The caller's environment without its MEMSPEC_* settings (the data dir kept), .venv/bin
    first on PATH, one thread (the box is shared) and tuned state in tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    if "MEMSPEC_DATA_DIR" in os.environ:
        env["MEMSPEC_DATA_DIR"] = os.environ["MEMSPEC_DATA_DIR"]
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env |= {"MEMSPEC_N_THREADS": "1", "MEMSPEC_STATE_DIR": str(tmp / "state")}
    return env


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each command but `serve`, run in README order; by subcommand."""
    require_gemma()
    env = user_env(tmp_path_factory.mktemp("walkthrough"))
    out = {}
    for command in commands():
        if subcommand(command) == "serve":
            continue
        # A datastore rebuild (a changed corpus) takes a few minutes; anything else seconds.
        out[subcommand(command)] = subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    return out


def ok(ran: dict[str, subprocess.CompletedProcess], name: str) -> subprocess.CompletedProcess:
    assert name in ran, f"the walkthrough has no `memspec {name}` line"
    r = ran[name]
    assert r.returncode == 0, f"memspec {name} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def test_the_section_is_found() -> None:
    names = [subcommand(c) for c in commands()]
    assert names == [
        "testbed fetch",
        "drafts build",
        "drafts list",
        "generate",
        "plan",
        "serve",
    ], names
    assert all(argv(c)[0] == "memspec" for c in commands())
    assert len(blocks("python")) == 1


def test_every_flag_shown_exists(tmp_path) -> None:
    env = user_env(tmp_path)
    for command in commands():
        words = argv(command)
        helped = subprocess.run(
            [*words[: 1 + len(subcommand(command).split())], "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert helped.returncode == 0, helped.stderr
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            # The whole flag: --k must not pass as --k-max.
            shown = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
            assert re.search(shown, helped.stdout), (command, flag)


def test_fetch(ran) -> None:
    r = ok(ran, "testbed fetch")
    assert any(line.endswith("gemma-3-270m-q4_k_m.gguf") for line in r.stdout.splitlines())


def test_drafts_build_says_what_it_built_and_skipped(ran) -> None:
    from memspec.drafts.family import family_dir
    from memspec.paths import models_dir

    r = ok(ran, "drafts build")
    head, *rest = r.stdout.splitlines()
    assert head.endswith(f"manifests in {family_dir(require_gemma())}"), head
    rows = {}
    for line in rest:
        m = re.fullmatch(r"(\S+)\s+(built|up to date|skipped)\s+(.+)", line)
        assert m, line
        rows[m[1]] = (m[2], m[3])
    for built, file in (("q2_k", "q2_k.gguf"), ("datastore-ci", "datastore-ci.npz")):
        assert rows[built] == (rows[built][0], str(models_dir() / f"gemma-3-270m-q4_k_m-{file}"))
        assert rows[built][0] in ("built", "up to date")
    for self_draft in ("q4_0", "q8_0"):
        status, reason = rows[self_draft]
        assert status == "skipped" and reason.startswith("the target is already 4.8 bits/weight")
    distill = "recipe distill builds llama-architecture students; the target is gemma3"
    assert rows["distill"] == ("skipped", distill)


def test_drafts_list_shows_the_family_compatible(ran) -> None:
    r = ok(ran, "drafts list")
    head, columns, *table = r.stdout.splitlines()
    assert "a llama tokenizer of 262144 tokens" in head
    assert columns.split() == ["id", "kind", "MB", "built", "target", "tags"]
    rows = {line.split()[0]: line.split() for line in table}
    for draft in GEMMA_DRAFTS:  # built: yes, target: yes (speaks the target's tokenizer)
        assert rows[draft][3:5] == ["yes", "yes"], rows[draft]
    assert "q4_0" not in rows  # the family skipped it: not in the pool at all
    assert "not usable with this target" not in r.stdout


def test_generate_prints_text(ran) -> None:
    r = ok(ran, "generate")
    assert r.stdout.strip(), r.stderr
    stats = re.search(r"\[(\d+) tokens, .* drafts \{.*\}\]", r.stderr)
    assert stats and 1 <= int(stats[1]) <= 24, r.stderr
    assert "not preloading" not in r.stderr  # the family's drafts are all there


def test_plan_fits(ran) -> None:
    r = ok(ran, "plan")
    assert "resident:" in r.stdout and "of 600.00 MiB" in r.stdout


def test_serve_and_the_openai_client(ran, tmp_path) -> None:
    """The serve line's flags on a launcher daemon; the README's client against it, whose
    greedy answer is the one `memspec generate` printed (same prompt, same max tokens)."""
    (serve,) = [c for c in commands() if subcommand(c) == "serve"]
    words = argv(serve)[2:]
    settings = {}
    while words:
        flag = words.pop(0)
        assert flag.startswith("--") and words, serve
        settings[flag[2:].replace("-", "_")] = words.pop(0)
    settings["n_ctx"] = 2048  # as `generate` ran: the same context as the CLI's default
    (snippet,) = blocks("python")
    assert README_URL in snippet
    with running(tmp_path, settings=settings) as daemon:
        scope: dict = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(snippet.replace(README_URL, daemon.url), "README.md", "exec"), scope)
        assert daemon.proc is not None and daemon.proc.poll() is None
    assert scope["model"] == GEMMA_MODEL
    answer = scope["reply"].choices[0].message.content
    assert answer and printed.getvalue() == answer + "\n"
    assert answer + "\n" == ok(ran, "generate").stdout  # lossless: the CLI's greedy text
