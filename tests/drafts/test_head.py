"""Draft kind "head": built by its recipe, lossless with the real target, refused cleanly when
its artifact or target is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from launcher import TARGET_FILE, require_testbed
from sampling_check import N_POWER, N_SAMPLES, PARAMS, exact_joint, null_threshold, tv

pytest.importorskip("torch")

import memspec.engine.sampling as sampling  # noqa: E402
import memspec.engine.speculative as spec  # noqa: E402
from memspec.backends.base import BackendOptions, load_backend  # noqa: E402
from memspec.drafts.compat import check_draft, fingerprint_of  # noqa: E402
from memspec.drafts.head import HeadDraft, read_meta  # noqa: E402
from memspec.drafts.manifest import load_manifests  # noqa: E402
from memspec.engine.calibration import measure  # noqa: E402
from memspec.engine.costs import AcceptanceEstimator  # noqa: E402
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy  # noqa: E402
from memspec.engine.sampling import SamplingParams  # noqa: E402
from memspec.errors import ModelLoadError  # noqa: E402
from memspec.memory.footprint import draft_footprint  # noqa: E402
from memspec.paths import models_dir  # noqa: E402
from memspec.recipes.build import build_all  # noqa: E402

TEXTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def head_data(tmp_path_factory):
    """A data directory of this module's own (the testbed target linked in, the target's
    cached answers shared): the head built here never joins the other tests' pool."""
    require_testbed()
    shared = models_dir().parent
    data = tmp_path_factory.mktemp("head-data")
    (data / "models").mkdir()
    (data / "models" / TARGET_FILE).symlink_to(shared / "models" / TARGET_FILE)
    (data / "cache").mkdir()
    if (shared / "cache" / "corpus").is_dir():
        (data / "cache" / "corpus").symlink_to(shared / "cache" / "corpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMSPEC_DATA_DIR", str(data))
        # Both cores (pytest runs one test at a time): the recipe's CI size is sized for that.
        mp.setenv("MEMSPEC_BUILD_THREADS", os.environ.get("MEMSPEC_BUILD_THREADS", "2"))
        yield data


@pytest.fixture(scope="module")
def head_ci(head_data):
    """The CI-size head, built by the real command path."""
    [(draft_id, path, _)] = build_all(only=["head-ci"])
    assert draft_id == "head-ci" and path.parent == head_data / "models"
    return path


@pytest.fixture(scope="module")
def target():
    be = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=512, features=True))
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(target):
    return [
        target.tokenize(target.chat_prompt([{"role": "user", "content": t}]), special=True)
        for t in TEXTS
    ]


# Slow tier: the recipe's labelling path (trainings run there); that transformers' features are
# llama.cpp's is checked in the default tier by tests/backends/test_features.py.
@pytest.mark.slow
@pytest.mark.models
def test_torch_teacher_gives_the_targets_features(target, prompts, tmp_path):
    """`teacher = "torch"` labels the corpus through transformers: the features a head is
    trained on must be the ones llama.cpp hands it when serving (same GGUF, both float32)."""
    from memspec.recipes.head_build import extract_features

    seqs = [p + p[:8] for p in prompts]
    llama, _ = extract_features(target, seqs, tmp_path / "llama.npz", progress=False)
    opts = BackendOptions(n_ctx=512, n_threads=2, features=True)
    teacher = load_backend(models_dir() / TARGET_FILE, opts, kind="torch")
    try:
        torch_feats, tops = extract_features(teacher, seqs, tmp_path / "torch.npz", False)
    finally:
        teacher.close()
    for a, b, top, s in zip(llama, torch_feats, tops, seqs, strict=True):
        assert a.shape == b.shape == (len(s), target.n_embd) and top.shape == (len(s),)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert cos.min() > 0.9999


def plain(target, prompt, params):
    target.reset()
    return spec.speculative_generate(target, prompt, params, FixedPolicy(None, 0))


def test_recipe_trained_and_reports(head_ci):
    info = json.loads(head_ci.with_name(head_ci.name + ".build.json").read_text())
    report = info["report"]
    assert report["loss_last"] < report["loss_first"] / 2
    held = report["heldout"]["all"]
    # A head that learned nothing agrees with the target about 1 time in 4,096.
    assert held["top1_agreement"] > 0.2
    assert 0.0 <= held["alpha1"] <= held["subvocab_coverage"] <= 1.0
    meta = read_meta(head_ci)
    assert meta["subvocab"] == 4096 and meta["n_embd"] == 576
    # The artifact names the target's tokenizer: compatible with it, refused for another.
    m = load_manifests()["head-ci"]
    assert check_draft(fingerprint_of(models_dir() / TARGET_FILE), m, models_dir()) is None


@pytest.fixture(scope="module")
def plain_outputs(target, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=40)
    return [plain(target, prompt, params).token_ids for prompt in prompts]


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_lossless_for_every_k(head_ci, target, prompts, plain_outputs, k):
    head = HeadDraft("head-ci", head_ci, target)
    params = SamplingParams(max_tokens=40)
    for prompt, want in zip(prompts, plain_outputs, strict=True):
        target.reset()
        gen = spec.speculative_generate(target, prompt, params, FixedPolicy(head, k))
        assert gen.token_ids == want
        assert gen.proposed > 0  # the head drafted every round it could
        assert 0 < gen.accepted < gen.proposed


def test_greedy_lossless_under_the_decision_rule(head_ci, target, prompts, plain_outputs):
    head = HeadDraft("head-ci", head_ci, target)
    costs = measure(target, [head], k_max=8)
    assert 0 < costs.draft_s["head-ci"] < costs.verify_s[0]  # calibrated per drafted token
    policy = DecisionRulePolicy([head], costs, AcceptanceEstimator(prior_alpha=0.9))
    params = SamplingParams(max_tokens=40)
    for prompt, want in zip(prompts, plain_outputs, strict=True):
        target.reset()
        assert spec.speculative_generate(target, prompt, params, policy).token_ids == want


def head_samples(head: HeadDraft, target, prompt: list[int], n: int) -> tuple[Counter, int]:
    """The first two tokens of `n` speculative samples (seeds 0..n-1) with the head at k 2, and
    the tokens it proposed."""
    counts: Counter = Counter()
    proposed = 0
    for seed in range(n):
        target.reset()  # a prefill each time: the head starts from its last feature
        sp = SamplingParams(max_tokens=2, seed=seed, **PARAMS)
        gen = spec.speculative_generate(target, prompt, sp, FixedPolicy(head, 2))
        counts[tuple(gen.token_ids)] += 1
        proposed += gen.proposed
    return counts, proposed


def fruit_prompt(target) -> list[int]:
    return target.tokenize(
        target.chat_prompt([{"role": "user", "content": "Name a fruit."}]), special=True
    )


def test_sampling_matches_the_target(head_ci, target):
    """The proposal is a distribution over the whole vocabulary (zero outside the head's
    sub-vocabulary); speculative samples of two tokens follow the target's exact joint."""
    head = HeadDraft("head-ci", head_ci, target)
    prompt = fruit_prompt(target)
    params = SamplingParams(**PARAMS)
    exact = exact_joint(target, prompt)
    # Half the engine's sample count (a head's sample costs ~0.3 s here): the acceptance rule
    # itself is held to N_SAMPLES in tests/engine; what this checks is the head's proposal
    # distribution entering it.
    n_exact = N_SAMPLES // 2
    threshold = null_threshold(exact, n_exact, np.random.default_rng(0))

    target.reset()
    target.eval(prompt[:-1], all_logits=False)
    proposal = head.propose(prompt, 2, params, np.random.default_rng(0))
    assert proposal.probs is not None and len(proposal.probs[0]) == target.n_vocab
    assert np.isclose(proposal.probs[0].sum(), 1.0)
    assert proposal.probs[0][proposal.tokens[0]] > 0
    counts, proposed = head_samples(head, target, prompt, n_exact)
    assert tv(counts, exact, n_exact) < threshold
    assert proposed >= n_exact  # the head proposed in every sample


# Slow tier: the harness's power with the head's proposal. The same harness's power against the
# same wrong rule is shown in the default tier (tests/engine/test_sampling_distribution.py).
@pytest.mark.slow
def test_argmax_only_acceptance_with_the_head_is_detected(head_ci, target, monkeypatch):
    """An argmax-only acceptance rule is caught by the harness above."""
    head = HeadDraft("head-ci", head_ci, target)
    prompt = fruit_prompt(target)
    exact = exact_joint(target, prompt)

    def argmax_accept(token, p, q, rng):  # wrong on purpose: accept iff it is p's argmax
        return int(np.argmax(p)) == token

    monkeypatch.setattr(sampling, "accept_draft_token", argmax_accept)  # the round's rule
    n = N_POWER
    counts, _ = head_samples(head, target, prompt, n)
    assert tv(counts, exact, n) > null_threshold(exact, n, np.random.default_rng(0))


def test_bad_artifacts_and_targets(head_ci, target, tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        HeadDraft("h", tmp_path / "missing.safetensors", target)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(head_ci.read_bytes()[: head_ci.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="damaged|readable"):
        HeadDraft("h", cut, target)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        HeadDraft("h", junk, target)
    # A head trained for another target: the hidden size does not match.
    from memspec.drafts.head import load_head_net, save_head

    net, sub_ids, meta = load_head_net(head_ci)
    other = tmp_path / "other.safetensors"
    save_head(net, sub_ids, other, {**meta, "n_embd": 640})
    with pytest.raises(ModelLoadError, match="n_embd 640"):
        HeadDraft("h", other, target)
    # A target loaded without features cannot feed a head: refused before anything loads.
    bare = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=64))
    try:
        with pytest.raises(ModelLoadError, match="without"):
            HeadDraft("h", head_ci, bare)
    finally:
        bare.close()


def test_footprint_matches_measured_memory(head_ci):
    """The footprint model against the RSS a real load adds, beside the resident target, in
    a process of its own (as tests/memory/test_footprint_measured.py does for every draft)."""
    out = subprocess.run(
        [sys.executable, "-m", "memspec.memory.probe", "head-ci", "--draft", "--n-ctx", "512"]
        + ["--resident", str(models_dir() / TARGET_FILE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    model = draft_footprint("head", head_ci, 512).total
    for phase in ("at_load", "steady"):
        rss = measured[phase]["rss"]
        assert abs(model - rss) <= max(0.15 * rss, 2_000_000), (phase, model, rss)


def test_runtime_serves_a_head(head_ci, tmp_path):
    """In the pool: the target gets features, the head loads, drafts and stays lossless; a
    damaged head file is a load failure with the reason, the runtime keeps serving."""
    from memspec.config import Settings
    from memspec.runtime import Runtime

    rt = Runtime(Settings.load(drafts=["prompt-lookup", "head-ci"], n_ctx=512))
    try:
        assert rt.target.options.features
        assert "head-ci" in rt.drafts
        prompt, params = rt.requests.prompt_tokens(TEXTS[0]), SamplingParams(max_tokens=32)
        want = rt.generate(prompt, params, draft="none").token_ids
        gen = rt.generate(prompt, params, draft="head-ci", k=4)
        assert gen.token_ids == want
        assert gen.per_draft["head-ci"]["proposed"] > 0
    finally:
        rt.close()


def test_damaged_head_in_the_pool_is_reported(head_ci, tmp_path, monkeypatch):
    from memspec.config import Settings
    from memspec.runtime import Runtime

    pool = tmp_path / "pool"
    pool.mkdir()
    shutil.copy(load_manifests()["head-ci"].source_path, pool / "head-ci.toml")
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    (models / TARGET_FILE).symlink_to(models_dir() / TARGET_FILE)
    (models / "head-ci.safetensors").write_bytes(head_ci.read_bytes()[:1000])
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path / "data"))
    settings = Settings.load(drafts=["head-ci"], n_ctx=256, manifest_dir=str(pool))
    rt = Runtime(settings, calibrate_costs=False)
    try:
        assert "head-ci" not in rt.drafts
        row = next(r for r in rt.draft_admin.draft_status() if r["id"] == "head-ci")
        assert "damaged" in json.dumps(row) or "readable" in json.dumps(row)
        gen = rt.generate(rt.requests.prompt_tokens("Hello"), SamplingParams(max_tokens=4))
        assert gen.completion_tokens == 4
    finally:
        rt.close()
