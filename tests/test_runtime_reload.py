"""A model loaded again for waiting requests (memspec.runtime.drafts_join_later): its model
drafts join later, priced as last measured, and its answers are still the target's own."""

from __future__ import annotations

import pytest
from launcher import MODEL_DRAFTS, require_testbed

from memspec import runtime as runtime_mod
from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec.runtime import Runtime, drafts_join_later

pytestmark = pytest.mark.models


def _settings() -> Settings:
    return Settings.load(n_ctx=512, n_threads=2, parallel=1, policy="memspec", drafts=None)


def _answer(rt: Runtime, draft: str) -> list[int]:
    prompt = rt.requests.prompt_tokens(
        messages=[{"role": "user", "content": "Name three colours."}]
    )
    params = SamplingParams(max_tokens=24, temperature=0.0)
    return rt.generate(prompt, params, draft=draft).token_ids


def test_a_reload_leaves_measured_model_drafts_for_later_and_answers_the_same():
    require_testbed()
    runtime_mod._draft_costs.clear()
    with drafts_join_later():  # nothing measured yet in this process: the family loads now
        first = Runtime(_settings())
    try:
        loaded_first = set(first.drafts)
        assert set(MODEL_DRAFTS) <= loaded_first
        plain = _answer(first, "none")
        measured = dict(first.costs.draft_s)
    finally:
        first.close()

    again = Runtime(_settings())  # outside the block: the whole family, as at a start
    try:
        assert set(again.drafts) == loaded_first
    finally:
        again.close()

    with drafts_join_later():
        reloaded = Runtime(_settings())
    try:
        resident = set(reloaded.drafts)
        later = loaded_first - resident
        assert set(MODEL_DRAFTS) <= later  # model drafts wait for the plan
        assert "prompt-lookup" in resident  # what costs no memory is there at once
        for draft_id in later & set(measured):  # priced: the plan weighs them before a load
            assert reloaded.costs.draft_s[draft_id] == pytest.approx(measured[draft_id])
        assert _answer(reloaded, "auto") == plain  # greedy: the target's own tokens
        assert _answer(reloaded, "none") == plain
    finally:
        reloaded.close()
