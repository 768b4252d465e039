"""A runtime starts where the last one on its target stopped (memspec.scheduler.learned): the
acceptance counts, the predictor's online weights and what was resident come back; a damaged
file or one learnt on another file of the same name is ignored, never fatal."""

from __future__ import annotations

import json

import pytest
from launcher import require_testbed

from memspec.config import Settings
from memspec.engine.sampling import SamplingParams
from memspec.scheduler.learned import learned_path

PROMPT = "Extract the names: Alice met Bob and Carol at the station; Alice and Carol left."


def _runtime(state_dir, drafts=("prompt-lookup", "q4_0")):
    from memspec.runtime import Runtime

    require_testbed()
    settings = Settings.load(
        drafts=list(drafts) if drafts is not None else None, n_ctx=512, state_dir=state_dir
    )
    return Runtime(settings, calibrate_costs=False)


def test_a_new_runtime_starts_from_what_the_last_one_learnt(tmp_path):
    rt = _runtime(tmp_path)
    try:
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPT}])
        for policy in ("auto", "memspec"):
            rt.generate(prompt, SamplingParams(max_tokens=24), draft="auto", policy=policy)
        learnt = rt.estimator.snapshot()
        # (a named policy's rule takes its priors from the predictor as it goes: compare counts)
        rules = {n: e.counts() for n, e in rt.scheduler.rule_estimators.items()}
        weights = rt.scheduler.predictor.to_dict()["keys"]
        assert learnt and weights, "nothing was learnt from two requests"
    finally:
        rt.close()
    resident = json.loads(learned_path(tmp_path, rt.target.path).read_text())["resident"]
    assert {"prompt-lookup", "q4_0"} <= set(resident)  # and what memspec's plan prefetched

    again = _runtime(tmp_path, drafts=None)  # the default pool: last time's resident first
    try:
        assert again.preload_ids[: len(resident)] == resident
        assert again.estimator.snapshot() == learnt
        assert {n: e.counts() for n, e in again.scheduler.rule_estimators.items()} == rules
        restored = again.scheduler.predictor.to_dict()["keys"]
        assert {k: restored[k] for k in weights} == weights
    finally:
        again.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: "{not json",
        lambda d: json.dumps({**d, "version": 99}),
        lambda d: json.dumps({**d, "target": {**d["target"], "bytes": 1}}),  # another file
    ],
)
def test_a_damaged_or_foreign_file_is_ignored(tmp_path, caplog, damage):
    rt = _runtime(tmp_path)
    path = learned_path(tmp_path, rt.target.path)
    rt.estimator.update("q4_0", 4, 4)
    rt.close()
    path.write_text(damage(json.loads(path.read_text())))
    again = _runtime(tmp_path)
    try:
        assert again.estimator.snapshot() == {}
        assert "ignoring" in caplog.text
    finally:
        again.close()
