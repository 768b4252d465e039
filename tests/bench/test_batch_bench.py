"""`memspec bench batch --cold` on the real target: new prompts only, the serial baseline on the
same prompts, and the check that every answer under concurrency is its solo answer."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from memspec.cli import main
from memspec_lab.bench import batch_cold
from memspec_lab.bench.peer_server import PeerServer

FIELDS = (
    "aggregate_tokens_per_s",
    "wall_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "per_stream_tokens_per_s_p50",
)


@pytest.mark.slow
@pytest.mark.timeout(600)  # four servers start (two per system); about 45 s on an idle box
def test_bench_batch_cold_cli(tmp_path, settings):
    config = tmp_path / "memspec.toml"
    config.write_text('drafts = ["prompt-lookup"]\nn_ctx = 1024\n')
    out = tmp_path / "batch-cold.json"
    peer = PeerServer.find() is not None
    rc = main(
        [
            "bench", "batch", "--cold", "--concurrency", "1,2", "--per-client", "1",
            "--max-tokens", "6", "--config", str(config), "--out", str(out),
            *([] if peer else ["--no-peer"]),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "cold" and report["parallel"] == 2
    assert report["prompts"] == {"distinct": 3, "chat": 1, "code": 2, "warmup": 2}
    # Nothing came from memspec's prefix cache, in either server.
    for run in ("concurrent", "serial"):
        assert report["memspec_prefix_cache"][run] == {"capacity": 0, "restores": 0}
    systems = {"memspec", "llama-server"} if peer else {"memspec"}
    assert set(report["configs"]) == systems and set(report["serial"]) == systems
    for name in systems:
        for c in ("1", "2"):
            row = report["configs"][name][c]
            assert row["errors"] == 0 and row["tokens"] > 0 and "texts" not in row
            assert all(row[f] is not None for f in FIELDS), (name, c)
            assert row["cached_tokens"] == 0 or name != "memspec" or c == "1"
        # The serial baseline: level 2's prompts, one at a time on a fresh server.
        assert set(report["serial"][name]) == {"2"}
        assert report["serial"][name]["2"]["requests"] == 2
        assert report["concurrent_vs_serial"][name]["2"]["x_serial"] > 0
    memspec = report["configs"]["memspec"]["2"]
    assert memspec["forward_passes"] > 0 and memspec["pass_tokens"] >= memspec["prompt_tokens"]
    check = report["solo_check"]["memspec"]
    assert check["enforced"] and check["passed"]
    assert check["identical"] == {"2": "2/2"} and check["compared"] == 2
    if peer:
        assert not report["solo_check"]["llama-server"]["enforced"]
        ratios = report["memspec_vs_llama_server"]["2"]
        assert set(FIELDS) <= set(ratios) and ratios["answers_equal"].endswith("/2")


def _row(texts: dict[str, str | None], wall: float) -> dict:
    return {
        "requests": len(texts),
        "errors": sum(t is None for t in texts.values()),
        "wall_s": wall,
        "aggregate_tokens_per_s": 10.0,
        "ttft_p50_s": 0.1,
        "ttft_p95_s": 0.2,
        "per_stream_tokens_per_s_p50": 5.0,
        "texts": texts,
    }


def _report(memspec_solo: str) -> dict:
    """Level 2's second answer is "c" under concurrency; alone it is `memspec_solo` on memspec
    and "Y" on llama-server."""
    conc = {"1": _row({"0": "a"}, 1.0), "2": _row({"1": "b", "2": "c"}, 1.0)}
    return {
        "configs": {"memspec": conc, "llama-server": json.loads(json.dumps(conc))},
        "serial": {
            "memspec": {"2": _row({"1": "b", "2": memspec_solo}, 1.5)},
            "llama-server": {"2": _row({"1": "b", "2": "Y"}, 1.5)},
        },
    }


def _summarised(report: dict) -> dict:
    batch_cold.summarise_cold(report)  # what run_cold_batch_bench ends with
    return report


def test_an_answer_that_differs_from_its_solo_answer_fails_the_run(tmp_path, monkeypatch):
    """memspec's check is enforced (exit 1, the mismatch quoted); llama-server's recorded."""
    args = Namespace(
        per_client=1, max_tokens=4, config=None, parallel=None, no_peer=False, plot=None
    )
    args.out = str(tmp_path / "r.json")
    report = _report("X")
    monkeypatch.setattr(batch_cold, "run_cold_batch_bench", lambda *a, **k: _summarised(report))
    assert batch_cold.cmd_batch_cold(args, [1, 2]) == 1
    mem = report["solo_check"]["memspec"]
    assert mem["identical"] == {"2": "1/2"} and not mem["passed"] and mem["enforced"]
    assert mem["mismatches"] == [{"level": 2, "request": 2, "concurrent": "c", "solo": "X"}]
    assert report["concurrent_vs_serial"]["memspec"]["2"]["x_serial"] == 1.5
    # llama-server alone differing: recorded, and the run passes.
    report = _report("c")
    monkeypatch.setattr(batch_cold, "run_cold_batch_bench", lambda *a, **k: _summarised(report))
    assert batch_cold.cmd_batch_cold(args, [1, 2]) == 0
    peer = report["solo_check"]["llama-server"]
    assert not peer["passed"] and not peer["enforced"] and peer["identical"] == {"2": "1/2"}
    assert json.loads((tmp_path / "r.json").read_text())["solo_check"]["memspec"]["passed"]


def test_cold_levels_never_repeat_a_prompt(settings):
    levels, warmup, counts = batch_cold.plan_levels([1, 2, 4, 8], 2, 16)
    bodies = [b for level in levels.values() for b in level] + warmup
    key = [json.dumps(b.get("messages") or b.get("prompt")) for b in bodies]
    assert len(set(key)) == len(key) == 30 + 2
    assert [len(v) for v in levels.values()] == [2, 4, 8, 16]
    assert counts == {"distinct": 30, "chat": 15, "code": 15, "warmup": 2}
    assert sorted(b["_id"] for level in levels.values() for b in level) == list(range(30))
