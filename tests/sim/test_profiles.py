"""Every shipped device profile loads; the hand-written ones say where their numbers come from."""

import pytest

from memspec_lab.sim.profile import PROFILE_DIR, load_profile

SHIPPED = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_profile_loads_with_costs_for_what_it_lists(name):
    p = load_profile(name)
    assert p.usable_bytes <= p.memory_bytes and p.target_bytes < p.usable_bytes
    # (a measured curve may dip from noise, so only its sign is checked)
    assert p.verify_s and min(p.verify_s) > 0
    for draft_id, cost in p.drafts.items():
        assert cost.bytes >= 0, draft_id
        assert cost.s_per_token > 0 or cost.overhead_s > 0, f"{draft_id} costs nothing"


def test_the_pair_profile_costs_the_sibling_from_the_published_rates():
    p = load_profile("jetson-orin-nano-8gb-qwen-coder")
    sibling = p.drafts["sibling-0.5b"]
    # 1.5B at ~34 tok/s and 0.5B at ~48 tok/s: the sibling's step is about 0.7 of the target's.
    assert 0.6 < sibling.s_per_token / p.verify_s[0] < 0.8
    text = (PROFILE_DIR / "jetson-orin-nano-8gb-qwen-coder.toml").read_text()
    assert "SIMULATED" in text  # a figure from it is never passed off as measured
