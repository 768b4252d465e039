"""Model drafts on the real testbed: a self-draft takes the target's prompt KV (its donor)
instead of catching up on the prompt itself."""

from __future__ import annotations

import numpy as np

from memspec.drafts.model import ModelDraft, shares_kv
from memspec.engine.types import SamplingParams


def _own_and_copied_logits(runtime, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The q8_0 draft's next-token logits after `prompt`: fed by itself, then from the target's
    copied cache (the target holding prompt[:-1], as after its prefill)."""
    draft = runtime.drafts["q8_0"]
    be = draft.backend
    be.reset()
    own = np.array(be.eval(prompt, all_logits=False)[-1])
    be.reset()
    runtime.target.reset()
    runtime.target.eval(prompt[:-1], all_logits=False)
    assert draft.catchup_tokens(prompt) == 1  # what the rule charges: the copy leaves one token
    proposal = draft.propose(prompt, 4, SamplingParams(max_tokens=4), np.random.default_rng(0))
    assert proposal.tokens and proposal.catchup_tokens == 1
    assert be.tokens[: len(prompt)] == prompt  # the copy, then its own steps
    be.truncate(len(prompt) - 1)
    copied = np.array(be.eval(prompt[-1:], all_logits=False)[-1])
    return own, copied


def test_a_self_draft_copies_the_targets_prompt_kv(runtime, chat_prompts):
    draft = runtime.drafts["q8_0"]
    assert draft.kv_donor is runtime.target
    assert any(r["id"] == "q8_0" and r["shares_target_kv"] for r in runtime.working_set.status())
    for prompt in chat_prompts:
        own, copied = _own_and_copied_logits(runtime, prompt)
        # The copied cache is the target's keys and values for the prompt, not an empty or
        # misplaced one: the draft predicts the same next token, with logits that track its own.
        assert int(np.argmax(copied)) == int(np.argmax(own))
        assert np.corrcoef(own, copied)[0, 1] > 0.99
    runtime.target.reset()


def test_no_donor_across_kv_layouts(runtime, gemma_runtime):
    q8 = runtime.drafts["q8_0"].backend
    assert not shares_kv(gemma_runtime.target, q8)
    assert ModelDraft("x", q8, kv_donor=gemma_runtime.target).kv_donor is None


class _RefusingDonor:
    """A donor of the right layout whose snapshot cannot be taken (a fault injected on purpose)."""

    def __init__(self, like, tokens: list[int]):
        self.n_ctx, self.tokens, self._layout = like.n_ctx, tokens, like.kv_layout()

    def kv_layout(self):
        return self._layout

    def kv_snapshot(self):
        return None


def test_a_donor_that_fails_leaves_the_draft_catching_up_by_itself(runtime, chat_prompts):
    prompt = chat_prompts[0]
    be = runtime.drafts["q8_0"].backend
    be.reset()
    draft = ModelDraft("q8_0", be, kv_donor=_RefusingDonor(be, prompt[:-1]))
    assert draft.kv_donor is not None and draft.catchup_tokens(prompt) == 1
    proposal = draft.propose(prompt, 3, SamplingParams(max_tokens=3), np.random.default_rng(0))
    assert proposal.tokens and proposal.catchup_tokens == len(prompt)
    assert draft.kv_donor is None and "snapshot" in (draft.donor_refused or "")
    assert be.tokens[: len(prompt)] == prompt
    be.reset()
