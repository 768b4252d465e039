"""The residency policies' rules (memspec.scheduler.residency), on hand-made views."""

from __future__ import annotations

import pytest

from memspec.scheduler.residency import (
    DemandEstimate,
    DemandResidency,
    LruResidency,
    ModelView,
    residency_policy,
)

MB = 1 << 20


def view(name: str, **kw) -> ModelView:
    base = dict(
        resident=True,
        bytes=500 * MB,
        in_flight=0,
        queued=0,
        pinned=False,
        last_used=0.0,
        load_s=2.0,
    )
    return ModelView(name=name, **(base | kw))


def test_demand_decays_with_its_half_life():
    d = DemandEstimate(half_life_s=10.0)
    for t in range(5):
        d.arrive("a", float(t))
    r4 = d.rate("a", 4.0)
    assert r4 > 0
    assert d.rate("a", 14.0) == pytest.approx(r4 / 2)
    assert d.rate("never", 4.0) == 0.0


def test_demand_evicts_the_least_valuable_idle_model():
    d = DemandEstimate(half_life_s=60.0)
    for _ in range(10):
        d.arrive("busy-one", 0.0)
    d.arrive("rare", 0.0)
    p = DemandResidency(d)
    models = [
        view("busy-one", last_used=1.0),
        view("rare", last_used=5.0),
        view("new", resident=False),
    ]
    # Only one has to go: the one with less predicted demand, though it was used last.
    assert p.victims("new", 500 * MB, 0, models, 1.0) == ["rare"]
    assert p.victims("new", 400 * MB, 500 * MB, models, 1.0) == []  # it fits already


def test_no_policy_evicts_in_flight_or_pinned_models():
    models = [
        view("running", in_flight=1),
        view("pinned", pinned=True),
        view("new", resident=False),
    ]
    for p in (DemandResidency(DemandEstimate()), LruResidency()):
        assert p.victims("new", 500 * MB, 0, models, 0.0) is None
    models.append(view("idle", bytes=600 * MB))
    for p in (DemandResidency(DemandEstimate()), LruResidency()):
        assert p.victims("new", 500 * MB, 0, models, 0.0) == ["idle"]


def test_lru_evicts_the_least_recently_used():
    models = [view("old", last_used=1.0), view("recent", last_used=9.0)]
    assert LruResidency().victims("new", 500 * MB, 0, models, 10.0) == ["old"]


def test_demand_holds_a_switch_while_the_resident_run_goes_on_but_not_forever():
    p = DemandResidency(DemandEstimate(), max_hold_s=5.0)
    want = view("new", resident=False, queued=1)
    running = [view("coder", in_flight=1, queued=3), want]
    assert p.hold(want, 1.0, running, 1.0)  # the coder's queued run goes first
    assert not p.hold(want, 5.0, running, 5.0)  # ... but never past max_hold_s
    drained = [view("coder", in_flight=1, queued=0), want]
    assert not p.hold(want, 0.1, drained, 0.1)  # nothing queued for it: switch now
    assert not LruResidency().hold(want, 0.0, running, 0.0)  # Ollama never holds


def test_prefetch_only_what_fits_and_is_wanted():
    d = DemandEstimate()
    d.arrive("chat", 0.0)
    p = DemandResidency(d)
    models = [view("chat", resident=False, bytes=300 * MB), view("idle", resident=False)]
    assert p.prefetch(400 * MB, models, 1.0) == "chat"
    assert p.prefetch(200 * MB, models, 1.0) is None  # does not fit the free budget
    assert LruResidency().prefetch(400 * MB, models, 1.0) is None


def test_policy_names():
    assert residency_policy("lru", DemandEstimate(), 1.0).name == "lru"
    assert residency_policy("memspec", DemandEstimate(), 1.0).first_come_first_served is False
    with pytest.raises(ValueError, match="unknown"):
        residency_policy("fifo", DemandEstimate(), 1.0)
