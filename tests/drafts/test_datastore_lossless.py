"""Greedy output with every built datastore draft is the target's own (real SmolLM2, k 1..8)."""

from __future__ import annotations

import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.datastore import DatastoreDraft, build_index
from memspec.drafts.manifest import load_manifests
from memspec.drafts.registry import instantiate
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import speculative_generate
from memspec.paths import models_dir

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

PROMPTS = [
    "Write a Python function that returns the largest element of a list.",
    "Explain why the sky is blue in two sentences.",
]
MAX_TOKENS = 24


def built_datastores() -> list[str]:
    """One manifest per built datastore file (datastore-live shares datastore's file)."""
    by_file: dict[str, str] = {}
    for m in sorted(load_manifests().values(), key=lambda m: m.build is None):
        if m.kind == "datastore" and m.model_path(models_dir()).is_file():
            by_file.setdefault(m.file or "", m.id)
    return sorted(by_file.values())


@pytest.fixture(scope="module")
def cases(small_backend_module):
    target = small_backend_module
    out = []
    for text in PROMPTS:
        prompt = target.tokenize(
            target.chat_prompt([{"role": "user", "content": text}]), special=True
        )
        target.reset()
        ref = speculative_generate(
            target, prompt, SamplingParams(max_tokens=MAX_TOKENS), FixedPolicy(None, 0)
        ).token_ids
        assert ref
        out.append((prompt, ref))
    return out


@pytest.fixture(scope="module")
def small_backend_module():
    path = models_dir() / "smollm2-135m-f32.gguf"
    if not path.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    be = load_backend(path, BackendOptions(n_ctx=512, n_threads=1))
    yield be
    be.close()


def check_lossless(target, draft, cases) -> int:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    accepted = 0
    for prompt, ref in cases:
        for k in range(1, 9):
            target.reset()
            gen = speculative_generate(target, prompt, params, FixedPolicy(draft, k))
            assert gen.token_ids == ref, f"{draft.id} k={k} diverged"
            accepted += gen.accepted
        target.reset()
        costs = CostModel(verify_s=[0.020, 0.024, 0.027, 0.031, 0.033, 0.035, 0.037, 0.039, 0.040])
        policy = DecisionRulePolicy([draft], costs, AcceptanceEstimator(0.5))
        assert speculative_generate(target, prompt, params, policy).token_ids == ref
    return accepted


def test_self_index_accepts_and_stays_lossless(small_backend_module, cases):
    # An index holding the reference outputs, one corrupted: proposals are mostly right, and
    # the wrong ones are rejected and rolled back.
    refs = [ref for _, ref in cases]
    broken = list(refs[1])
    broken[len(broken) // 2] = (broken[len(broken) // 2] + 1) % 49152
    draft = DatastoreDraft("self", build_index([refs[0], broken]), use_context=False, learn=False)
    assert check_lossless(small_backend_module, draft, cases) > MAX_TOKENS


@pytest.mark.parametrize("draft_id", built_datastores() or ["<none built>"])
def test_every_built_datastore_is_lossless(small_backend_module, cases, draft_id):
    if draft_id == "<none built>":
        pytest.fail("no datastore draft built: run `memspec drafts build`", pytrace=False)
    m = load_manifests()[draft_id]
    draft = instantiate(m, BackendOptions(), "llama_cpp")
    draft.learn = False
    check_lossless(small_backend_module, draft, cases)


def test_runtime_files_each_output_in_a_learning_datastore_at_once(tmp_path):
    """A learning datastore holds a request's whole output when the request returns, and the
    same prompt again is then drafted from it, still identical to the target's output."""
    from memspec.config import Settings
    from memspec.runtime import Runtime

    real = models_dir()
    (tmp_path / "learner.toml").write_text(
        'id = "learner"\nkind = "datastore"\nfile = "datastore-ci.npz"\n'
        "[params]\nuse_context = 0\nlearn = 1\n"
    )
    if not (real / "datastore-ci.npz").is_file():
        pytest.fail("datastore-ci missing: run `memspec drafts build`", pytrace=False)
    s = Settings.load(
        target=str(real / "smollm2-135m-f32.gguf"),
        drafts=["learner"],
        manifest_dir=str(tmp_path),
        n_ctx=512,
        n_threads=1,
        budget="4GiB",
    )
    rt = Runtime(s, calibrate_costs=False)
    try:
        rt.working_set.wait_idle(60)
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPTS[1]}])
        params = SamplingParams(max_tokens=MAX_TOKENS)
        first = rt.generate(prompt, params, draft="learner")
        learner = rt.working_set.get("learner")
        assert learner.recent_tokens == len(first.token_ids)
        second = rt.generate(prompt, params, draft="learner", k=8)
        assert second.token_ids == first.token_ids
        # Drafted from the filed output (its first tokens have no two-token match yet).
        assert second.accepted > first.accepted
        assert second.accepted >= 0.75 * len(first.token_ids)
    finally:
        rt.close()
