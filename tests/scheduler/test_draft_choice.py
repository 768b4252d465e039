"""The request's `draft` field, decoded in one place."""

from __future__ import annotations

import pytest

from memspec.scheduler.draft_choice import DraftAsk


def test_none_is_plain_decoding():
    ask = DraftAsk.parse("none")
    assert ask.plain and not ask.auto and ask.named is None
    assert str(ask) == "none"
    with pytest.raises(AssertionError):
        _ = ask.ids  # a plain request uses no draft


def test_auto_lets_the_scheduler_decide():
    ask = DraftAsk.parse("auto")
    assert ask.auto and not ask.plain and ask.named is None
    assert ask.ids is None and str(ask) == "auto"


@pytest.mark.parametrize("raw", ["q8_0", "prompt-lookup", "", "AUTO", "None"])
def test_anything_else_names_a_draft(raw):
    ask = DraftAsk.parse(raw)
    assert ask.named == raw and not ask.plain and not ask.auto
    assert ask.ids == [raw] and str(ask) == raw
