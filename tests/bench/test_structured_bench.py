"""`memspec bench structured` end to end on the real target (two tiny prompts of a workload of
the test's own, so nothing is fitted to the held-out one), and its schema check."""

from __future__ import annotations

import json

import pytest
from launcher import TARGET_FILE

from memspec.cli import main
from memspec.paths import models_dir
from memspec_lab.bench.peer_server import PeerServer
from memspec_lab.bench.structured import _basic_schema_error, load_extraction_prompts, schema_error


def strict(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


# Enums and integers: outputs that end within a few tokens, even from a 135M model.
WORKLOAD = [
    {
        "id": "capital",
        "category": "chat",
        "chat": True,
        "prompt": "Which city is the capital of France? Answer as JSON.",
        "json_schema": {
            "name": "capital",
            "strict": True,
            "schema": strict({"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}}),
        },
    },
    {
        "id": "order",
        "category": "text",
        "chat": False,
        "prompt": "Order 4417: 3 pears.\nThe same order as JSON: ",
        "json_schema": {
            "name": "order",
            "strict": True,
            "schema": strict(
                {
                    "order": {"type": "integer"},
                    "fruit": {"type": "string", "enum": ["apple", "pear"]},
                    "count": {"type": "integer"},
                }
            ),
        },
    },
]
MEMSPEC_CONFIGS = ["none", "memspec", "auto", "prompt-lookup adaptive-k", "q4_0 adaptive-k"]


@pytest.mark.slow
def test_bench_structured_outputs_identical_and_valid(tmp_path, settings):
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps(row) + "\n" for row in WORKLOAD))
    out = tmp_path / "structured.json"
    peer = PeerServer.find() is not None
    configs = MEMSPEC_CONFIGS[1:] + (["llama-server plain"] if peer else [])
    args = [
        "bench", "structured", "--target", str(models_dir() / TARGET_FILE), "--n-threads", "1",
        "--n-ctx", "1024", "--drafts", "prompt-lookup,q4_0", "--workload", str(workload),
        "--max-tokens", "48", "--configs", ",".join(configs), "--out", str(out),
        # memspec's own grammar: llama-server's outputs must then equal plain decoding's too.
        "--peer-constraint", "grammar",
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "structured" and report["prompts"] == ["capital", "order"]
    assert report["all_identical"] is True and report["all_valid"] is True
    assert set(report["configs"]) == set(MEMSPEC_CONFIGS) | (
        {"llama-server plain"} if peer else set()
    )
    for name, entry in report["configs"].items():
        o = entry["overall"]
        assert o["identical_to_plain"] is True and o["valid"] == 2, name
        assert o["tokens_per_s"] > 0 and set(entry["per_prompt"]) == {"capital", "order"}, name
        for run in entry["runs"]:
            assert run["finish_reason"] == "stop" and run["schema_error"] is None, (name, run)
            assert json.loads(run["text"]), name
    assert report["configs"]["none"]["overall"]["speedup"] == 1.0
    if peer:
        assert report["llama_server_best"]["config"] == "llama-server plain"
        assert report["configs"]["none"]["overall"]["vs_llama_server_best"] > 0
    else:
        assert report["llama_server_best"] is None and report["peer_server_skipped"]


def test_held_out_workload_is_strict_schemas():
    prompts = load_extraction_prompts()
    assert len(prompts) == 8 and {p.chat for p in prompts} == {True, False}
    for p in prompts:
        assert p.json_schema["strict"] is True and p.schema["additionalProperties"] is False
        assert set(p.schema["required"]) == set(p.schema["properties"]), p.id


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"city": "Paris", "n": 3}, None),
        ({"city": "Paris"}, "missing ['n']"),
        ({"city": "Paris", "n": 3, "x": 1}, "extra keys ['x']"),
        ({"city": "Rome", "n": 3}, "not in"),
        ({"city": "Paris", "n": True}, "$.n: not integer"),
        ({"city": "Paris", "n": 2.5}, "$.n: not integer"),
    ],
)
def test_schema_check_without_jsonschema(value, error):
    schema = strict({"city": {"type": "string", "enum": ["Paris"]}, "n": {"type": "integer"}})
    got = _basic_schema_error(value, schema, "$")
    assert got is None if error is None else error in got
    # The same verdict from the check the bench runs (jsonschema's when installed).
    assert (schema_error(json.dumps(value), schema) is None) == (error is None)
    assert schema_error('{"city": "Par', schema).startswith("not JSON")


def test_bench_structured_unknown_config_names_the_known_ones(tmp_path, settings, capsys):
    out = tmp_path / "x.json"
    args = ["bench", "structured", "--n-threads", "1", "--n-ctx", "1024", "--no-peer-server"]
    assert main([*args, "--out", str(out), "--configs", "memspec,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench configs ['bogus']" in err and "prompt-lookup adaptive-k" in err
    assert not out.exists()
