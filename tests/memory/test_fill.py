"""The one value-per-byte fill all working sets use."""

from memspec.memory.fill import fill_by_value


def test_densest_first_while_it_fits():
    items = [("big", 3.0, 300), ("small", 2.0, 100), ("worthless", 0.0, 1), ("lookup", 1.0, 0)]
    assert fill_by_value(items, 350) == ["lookup", "small"]
    assert fill_by_value(items, 400) == ["lookup", "small", "big"]
    assert fill_by_value(items, -1) == []


def test_most_valuable_first_keeps_the_best_draft_in_a_one_draft_budget():
    items = [("small", 2.0, 100), ("big", 3.0, 300)]
    assert fill_by_value(items, 300) == ["small"]
    assert fill_by_value(items, 300, top_first=True) == ["big"]
    assert fill_by_value(items, 400, top_first=True) == ["big", "small"]
