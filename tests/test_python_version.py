"""Python 3.10 (JetPack 6's) runs MemSpec: the backports in memspec.compat behave as the 3.11
standard library's, and vermin finds nothing newer than 3.10 in the code (fast, no models)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from enum import auto
from pathlib import Path

import pytest

from memspec.compat import StrEnum, tomllib
from memspec.scheduler.working_set import DraftState
from memspec.server.engine_state import EngineState

ROOT = Path(__file__).resolve().parents[1]


class Colour(StrEnum):
    RED = "red"
    DARK_BLUE = auto()


def test_str_enum_members_are_their_value_everywhere():
    m = Colour.RED
    # Every way of formatting, the old ones too (logging's "%s").
    assert str(m) == f"{m}" == format(m) == "{}".format(m) == "%s" % m == "red"  # noqa: UP031, UP032
    assert f"{m:>5}|{m:<5}|" == "  red|red  |"
    assert m == "red" and "red" == m and m in {"red"} and {m: 1}["red"] == 1
    assert hash(m) == hash("red") and isinstance(m, str)
    assert json.dumps({m: m}) == '{"red": "red"}'
    assert Colour("red") is m and Colour.DARK_BLUE == "dark_blue"
    assert repr(m) == "<Colour.RED: 'red'>"
    assert m.upper() == "RED" and m + "!" == "red!"


@pytest.mark.parametrize("enum", [EngineState, DraftState])
def test_the_state_enums_print_as_their_value(enum):
    """/health's "not ready: {state}", /admin/status and the logs print these members."""
    for m in enum:
        assert str(m) == f"{m}" == m.value and json.dumps(m) == json.dumps(m.value)
    assert f"not ready: {EngineState.LOADING}" == "not ready: loading"
    if sys.version_info >= (3, 11):
        import enum as std

        assert issubclass(enum, StrEnum) and not issubclass(enum, std.StrEnum)  # novermin


def test_tomllib_reads_toml():
    assert tomllib.loads('a = 1\n[b]\nc = "x"\n') == {"a": 1, "b": {"c": "x"}}
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("a = = 1")


@pytest.mark.skipif(importlib.util.find_spec("vermin") is None, reason="vermin not installed")
@pytest.mark.timeout(120)
def test_nothing_newer_than_python_3_10():
    """The same check as scripts/test.sh (about 4 s): a 3.11-only module, member or syntax
    anywhere in the package, the tests or scripts/ fails here, naming the file."""
    run = "import sys, vermin; sys.exit(vermin.main())"  # vermin has no __main__
    cmd = [sys.executable, "-c", run, "-q", "-t=3.10-", "--violations", "--no-tips"]
    cmd += ["--eval-annotations", "memspec", "tests", "scripts"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
