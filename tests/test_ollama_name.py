"""Ollama's model-name rules (memspec/ollama_name.py) and the keep_alive bound (memspec/units.py):
pure functions, no daemon."""

from __future__ import annotations

import pytest

from memspec import ollama_name, pull
from memspec.errors import InvalidRequest
from memspec.ollama_name import InvalidModelName, OllamaName, parse
from memspec.units import FOREVER, MAX_DURATION_S, parse_duration_s


@pytest.mark.parametrize(
    ("name", "parts", "display"),
    [
        ("smollm2", ("registry.ollama.ai", "library", "smollm2", "latest"), "smollm2:latest"),
        ("qwen2.5-coder:1.5b", ("registry.ollama.ai", "library", "qwen2.5-coder", "1.5b"),
         "qwen2.5-coder:1.5b"),
        ("library/gemma3:270m", ("registry.ollama.ai", "library", "gemma3", "270m"),
         "gemma3:270m"),
        ("me/mine:v1", ("registry.ollama.ai", "me", "mine", "v1"), "me/mine:v1"),
        ("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
         ("hf.co", "bartowski", "SmolLM2-135M-Instruct-GGUF", "Q4_K_M"),
         "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"),
        ("localhost:5000/ns/name:tag", ("localhost:5000", "ns", "name", "tag"),
         "localhost:5000/ns/name:tag"),
        ("localhost:5000/ns/name", ("localhost:5000", "ns", "name", "latest"),
         "localhost:5000/ns/name:latest"),
        ("https://registry.ollama.ai/library/smollm2:135m",
         ("registry.ollama.ai", "library", "smollm2", "135m"), "smollm2:135m"),
        # File names this daemon serves models under: dots and case are allowed.
        ("smollm2-135m-f32.gguf", ("registry.ollama.ai", "library", "smollm2-135m-f32.gguf",
                                   "latest"), "smollm2-135m-f32.gguf:latest"),
        ("SmolLM2-135M-Instruct.Q4_1", ("registry.ollama.ai", "library",
                                        "SmolLM2-135M-Instruct.Q4_1", "latest"),
         "SmolLM2-135M-Instruct.Q4_1:latest"),
        ("_x:_y", ("registry.ollama.ai", "library", "_x", "_y"), "_x:_y"),
    ],
)  # fmt: skip
def test_valid_names(name, parts, display):
    n = parse(name)
    assert (n.host, n.namespace, n.model, n.tag) == parts
    assert n.display == display


def test_local_form_keeps_what_was_written_less_the_defaults():
    assert parse("smollm2-135m-f32").local == "smollm2-135m-f32"
    assert parse("smollm2-135m-f32:latest").local == "smollm2-135m-f32:latest"
    assert parse("registry.ollama.ai/library/smollm2:135m").local == "smollm2:135m"
    assert parse("Library/SmolLM2").local == "SmolLM2"
    assert parse("hf.co/u/r:Q4_0").local == "hf.co/u/r:Q4_0"
    assert parse("hf.co/u/r").full == "hf.co/u/r:latest"
    assert ollama_name.check(None) is None and ollama_name.check("") is None
    assert isinstance(ollama_name.check("a"), OllamaName)


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "/abs/path/model.gguf",
        "a" * 5000,
        "a" * 81,  # the model part: 80 at most
        "ns/" + "a" * 81,
        "n" * 81 + "/m",
        "m:" + "t" * 81,
        "name;rm -rf /",
        "name;rm",
        "$(reboot)",
        "a b",
        "a\nb",
        "model\n",
        " model",
        "",
        ":",
        "x:",
        ":tag",
        "ns/",
        "/m",
        "a/b/c/d",  # more than host/namespace/model
        "ns.x/model",  # '.' is not a namespace character
        "-model",
        ".hidden",
        "model@sha256:abc",
        "mödel",  # ASCII only
        "http://ns/model",  # a scheme needs a host
        "ftp://host/ns/model",
        "h" * 351 + "/ns/m",
    ],
)
def test_invalid_names(name):
    with pytest.raises(InvalidModelName) as e:
        parse(name)
    assert e.value.message.startswith("invalid model name")
    assert isinstance(e.value, InvalidRequest) and e.value.param == "model"
    assert len(e.value.message) < 300  # never the whole name echoed


def test_longest_parts_are_valid():
    parse("h" * 350 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80)


def test_pull_resolve_checks_the_name_first():
    with pytest.raises(InvalidModelName):
        pull.resolve_family("../../etc/passwd")
    with pytest.raises(pull.ModelNotFound):
        pull.resolve_family("hf.co/someone/smollm2:135m")  # valid, but not a library name we fetch
    assert pull.resolve_family("registry.ollama.ai/library/SmolLM2:135m").name == "smollm2:135m"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("300", 300.0),
        (300, 300.0),
        (0, 0.0),
        ("0s", 0.0),
        (-1, FOREVER),
        ("-1m", FOREVER),
        # Beyond the bound, or infinite: no expiry, never a number added to a clock.
        ("9999999999999h", FOREVER),
        ("-9999999999h", FOREVER),
        (float("inf"), FOREVER),
        (float("-inf"), FOREVER),
        (1e400, FOREVER),
        ("1e400", FOREVER),
        (10**400, FOREVER),
        (-(10**400), FOREVER),
        (MAX_DURATION_S, MAX_DURATION_S),
        (MAX_DURATION_S + 1, FOREVER),
    ],
)
def test_durations_are_bounded(value, seconds):
    assert parse_duration_s(value) == seconds


@pytest.mark.parametrize("value", ["soon", "inf", "nan", float("nan"), "1" * 65, "", True, "1h 1m"])
def test_malformed_durations(value):
    with pytest.raises(ValueError):
        parse_duration_s(value)
