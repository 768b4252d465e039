"""The lead slot on a batched runtime: only it runs the request's policy over every draft kind;
a slot beside it runs the rule over free drafts, and each Generation (the response's `memspec`
object) says which policy it actually ran under. Output stays the target's own."""

from __future__ import annotations

import pytest

from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec.paths import models_dir
from memspec.scheduler.rounds import LEAD_SLOT
from memspec.server.openai_api import memspec_stats

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

PROMPTS = ["Count from one to ten in words: one, two,", "The three primary colours are"]


def test_the_lead_slot_runs_the_policy_and_the_others_say_they_ran_auto(tmp_path):
    from memspec.request_check import GenerationRequest
    from memspec.runtime import Runtime

    if not (models_dir() / "smollm2-135m-f32.gguf").is_file():
        pytest.fail("testbed missing: run scripts/setup.sh", pytrace=False)
    settings = Settings.load(
        drafts=["prompt-lookup", "q4_0"],
        n_ctx=512,
        n_threads=1,
        budget="1200MB",
        parallel=2,
        policy="memspec",
        state_dir=tmp_path,
    )
    rt = Runtime(settings, batched=True)
    try:
        params = SamplingParams(max_tokens=24)
        reqs = [GenerationRequest(rt.requests.prompt_tokens(prompt=p), params) for p in PROMPTS]
        alone = [rt.generate(r.prompt, params, draft="none").token_ids for r in reqs]
        lead = rt.open_sequence(reqs[0], LEAD_SLOT, alone=False)
        beside = rt.open_sequence(reqs[1], LEAD_SLOT + 1, alone=False)
        while not (lead.done and beside.done):
            rt.decode_round([s for s in (lead, beside) if not s.done])
        gens = [rt.close_sequence(s) for s in (lead, beside)]
        assert [g.token_ids for g in gens] == alone
        # memspec configured, but a lead among other requests runs auto; beside it, auto too.
        assert [(g.policy, g.lead) for g in gens] == [("auto", True), ("auto", False)]
        assert memspec_stats(gens[1])["policy"] == "auto"
        assert memspec_stats(gens[1])["lead_slot"] is False
        assert set(gens[1].drafts_used) <= {"prompt-lookup"}  # free drafts only
        # Alone, the lead runs the configured policy.
        solo = rt.open_sequence(reqs[0], LEAD_SLOT, alone=True)
        while not solo.done:
            rt.decode_round([solo])
        gen = rt.close_sequence(solo)
        assert (gen.policy, gen.lead, gen.token_ids) == ("memspec", True, alone[0])
    finally:
        rt.close()
