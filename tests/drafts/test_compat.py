"""Drafts must speak the target's tokenizer: fingerprints from real GGUF headers, llama.cpp's
rule, and a runtime (and a daemon) that leaves a draft of another tokenizer out of its pool
and answers a request naming it with DraftIncompatible (HTTP 400 draft_incompatible).

The two tokenizers are the testbed's SmolLM2 (BPE "gpt2", 49,152 tokens) and Gemma 3 270M
(SentencePiece "llama", 262,144 tokens)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import httpx
import pytest
from launcher import ADMIN_KEY, API_KEY, MODEL, N_THREADS, TARGET_FILE, require_testbed, running

from memspec.config import Settings
from memspec.drafts.compat import (
    TokenizerFingerprint,
    check_draft,
    fingerprint_of,
    incompatibility,
)
from memspec.drafts.datastore import FORMAT_VERSION, load_datastore
from memspec.drafts.manifest import BuildRecipe, load_manifests
from memspec.drafts.registry import instantiate
from memspec.engine.sampling import SamplingParams
from memspec.errors import DraftIncompatible
from memspec.paths import data_dir, models_dir
from memspec.recipes.datastore import build_datastore_file

REAL_DATA_DIR = data_dir()  # before the module's pool points MEMSPEC_DATA_DIR elsewhere
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
SMOL_DRAFT_FILE = "smollm2-135m-q4_0.gguf"

try:
    from launcher import require_gemma
except ImportError:  # until tests/launcher.py has the shared helper

    def require_gemma() -> None:
        if not (models_dir() / GEMMA_FILE).is_file():
            pytest.skip(f"{GEMMA_FILE} missing: run `memspec testbed fetch --family gemma3`")


def _smol() -> TokenizerFingerprint:
    require_testbed()
    fp = fingerprint_of(models_dir() / TARGET_FILE)
    assert fp is not None
    return fp


@functools.cache  # asked once, before the module's pool points MEMSPEC_DATA_DIR elsewhere
def _gemma_path() -> Path:
    got = require_gemma()  # the shared helper returns the file; the local one does not
    return got if isinstance(got, Path) else models_dir() / GEMMA_FILE


def _gemma() -> TokenizerFingerprint:
    fp = fingerprint_of(_gemma_path())
    assert fp is not None
    return fp


# --- fingerprints and the rule ------------------------------------------------------------


def test_same_tokenizer_other_weights_same_fingerprint():
    f32, q4 = _smol(), fingerprint_of(models_dir() / SMOL_DRAFT_FILE)
    assert q4 is not None
    assert f32 == q4 and f32.digest == q4.digest
    assert (f32.model, f32.n_vocab, f32.bos_id, f32.eos_id) == ("gpt2", 49152, 1, 2)
    assert incompatibility(f32, q4) is None and incompatibility(q4, f32) is None


def test_other_tokenizer_refused_both_ways_with_a_reason():
    smol, gemma = _smol(), _gemma()
    assert (gemma.model, gemma.n_vocab) == ("llama", 262144)
    assert smol != gemma and smol.digest != gemma.digest
    reason = incompatibility(target=gemma, draft=smol)
    assert reason == (
        f"built for a gpt2 tokenizer of 49152 tokens (fingerprint {smol.digest}); "
        f"the target has a llama tokenizer of 262144 tokens (fingerprint {gemma.digest})"
    )
    back = incompatibility(target=smol, draft=gemma)
    assert back is not None and back.startswith("built for a llama tokenizer of 262144 tokens")


def test_fingerprint_round_trips_through_a_dict():
    smol = _smol()
    d = smol.to_dict()
    assert d["digest"] == smol.digest and "source" not in d
    back = TokenizerFingerprint.from_dict(d)
    assert back == smol and back.source is None
    with pytest.raises(ValueError, match="digest"):
        TokenizerFingerprint.from_dict({**d, "n_vocab": 49153})
    with pytest.raises(ValueError):
        TokenizerFingerprint.from_dict({"model": "gpt2"})


def test_llama_cpp_rule_details():
    smol, gemma = _smol(), _gemma()
    swapped = dataclasses.replace(smol, bos_id=2, eos_id=1)
    assert "BOS/EOS ids 2/1 here, 1/2 in the target" in incompatibility(smol, swapped)
    adds = dataclasses.replace(smol, add_bos=True)
    assert "add_bos True here, False in the target" in incompatibility(smol, adds)
    bigger = dataclasses.replace(smol, n_vocab=smol.n_vocab + 200)
    assert "differ by 200 tokens, more than 128" in incompatibility(smol, bigger)
    # Sizes within 128 and other hashes: the token texts are compared over the shared ids.
    # The same file's texts agree (a target with a few added tokens keeps its drafts) ...
    grown = dataclasses.replace(smol, n_vocab=smol.n_vocab + 100, tokens_sha256="0" * 64)
    assert incompatibility(grown, smol) is None
    # ... another vocabulary's texts do not (Gemma's file posing as a gpt2 one of that size),
    alike = dataclasses.replace(
        gemma, model="gpt2", n_vocab=smol.n_vocab, bos_id=1, eos_id=2, add_bos=False
    )
    reason = incompatibility(smol, alike)
    assert reason is not None and "token 5 is b'[multimodal]' here, b'<file_sep>'" in reason
    # ... and a fingerprint with no file behind it (a datastore's) cannot be compared.
    stored = TokenizerFingerprint.from_dict(grown.to_dict())
    assert "only their hashes are known" in incompatibility(smol, stored)


# --- a pool in a data dir of its own ---------------------------------------------------------

MANIFESTS = {
    "prompt-lookup": 'kind = "prompt_lookup"\n[params]\nmax_ngram = 3\nmin_ngram = 2\n',
    "q4_0": f'kind = "model"\nfile = "{SMOL_DRAFT_FILE}"\n',
    "gemma": f'kind = "model"\nfile = "{GEMMA_FILE}"\n',
    "ds-smol": 'kind = "datastore"\nfile = "ds-smol.npz"\n[params]\nlearn = 0\n',
    "ds-gemma": 'kind = "datastore"\nfile = "ds-gemma.npz"\n[params]\nlearn = 0\n',
    "ds-old": 'kind = "datastore"\nfile = "ds-old.npz"\n[params]\nlearn = 0\n',
    "not-built": 'kind = "model"\nfile = "nowhere.gguf"\n',
}


def _tiny_datastore(src: Path, dst: Path) -> dict:
    """A real datastore build, small: package text only (no generation), a few k tokens."""
    recipe = BuildRecipe(
        recipe="datastore", source=src.name, seeds_per_domain=0, gen_tokens=0, package_chars=3000
    )
    return build_datastore_file(recipe, src, dst, progress=False)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, monkeypatch_module) -> Path:
    """MEMSPEC_DATA_DIR with the real models linked in, datastores built for each tokenizer
    (and one in the format before fingerprints), and a manifest dir naming them all."""
    require_testbed()
    real = {name: models_dir() / name for name in (TARGET_FILE, SMOL_DRAFT_FILE)}
    real[GEMMA_FILE] = _gemma_path()
    root = tmp_path_factory.mktemp("compat")
    models = root / "data" / "models"
    models.mkdir(parents=True)
    for name, path in real.items():
        (models / name).symlink_to(path)
    monkeypatch_module.setenv("MEMSPEC_DATA_DIR", str(root / "data"))
    report = _tiny_datastore(models / TARGET_FILE, models / "ds-smol.npz")
    assert report["tokenizer"]["n_vocab"] == 49152 and report["package_tokens"] > 300
    _tiny_datastore(models / GEMMA_FILE, models / "ds-gemma.npz")
    # The format before fingerprints: the same index, its metadata without "tokenizer".
    from memspec.drafts.datastore import load_index, save_index

    index, meta = load_index(models / "ds-smol.npz")
    del meta["tokenizer"]
    save_index(models / "ds-old.npz", index, meta)
    mdir = root / "drafts"
    mdir.mkdir()
    for draft_id, body in MANIFESTS.items():
        (mdir / f"{draft_id}.toml").write_text(f'id = "{draft_id}"\n{body}')
    return mdir


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_datastore_records_its_tokenizer(pool):
    models = models_dir()
    ds = load_datastore("ds-gemma", models / "ds-gemma.npz")
    assert ds.meta["format"] == FORMAT_VERSION
    assert ds.tokenizer == fingerprint_of(models / GEMMA_FILE)
    assert load_datastore("ds-old", models / "ds-old.npz").tokenizer is None


def test_per_kind_rule(pool):
    manifests = load_manifests(pool)
    smol, gemma = _smol(), _gemma()
    reasons = {i: check_draft(smol, m, models_dir()) for i, m in manifests.items()}
    refused = {i for i, r in reasons.items() if r is not None}
    assert refused == {"gemma", "ds-gemma", "ds-old"}  # not-built: a load failure, not this
    assert reasons["ds-gemma"] == incompatibility(smol, gemma)
    assert "rebuild it with `memspec drafts build --only ds-old`" in reasons["ds-old"]
    back = {i for i, m in manifests.items() if check_draft(gemma, m, models_dir())}
    assert back == {"q4_0", "ds-smol", "ds-old"}
    # Loading one anyway (a file rebuilt after the runtime checked it) is refused as well.
    from memspec.backends.base import BackendOptions

    with pytest.raises(DraftIncompatible, match="llama tokenizer of 262144"):
        instantiate(manifests["ds-gemma"], BackendOptions(n_ctx=256), "llama_cpp", smol)


def _runtime(pool: Path, target: str):
    from memspec.runtime import Runtime

    drafts = ["prompt-lookup", "q4_0", "gemma", "ds-smol", "ds-gemma"]
    settings = Settings.load(
        target=target, drafts=drafts, manifest_dir=pool, n_ctx=512, n_threads=N_THREADS
    )
    return Runtime(settings, calibrate_costs=False)  # calibration writes a cache: not here


def _check_refused(rt, refused: set[str], served: set[str], caplog) -> None:
    from memspec.request_check import ClientRequest

    rows = {r["id"]: r for r in rt.draft_admin.draft_status()}
    assert set(rows) == set(MANIFESTS)  # every manifest is listed, usable or not
    assert {i for i, r in rows.items() if not r["compatible"]} == refused
    for draft_id in refused:
        assert rows[draft_id]["reason"] and not rows[draft_id]["resident"]
        assert draft_id not in rt.working_set.source.draft_ids()
        assert f"fixed:{draft_id}" not in rt.policies
    assert {i for i, r in rows.items() if r["resident"]} == served
    # Preloading an incompatible draft named in settings.drafts: one warning, start goes on.
    warned = [r.getMessage() for r in caplog.records if "not preloading" in r.getMessage()]
    assert sorted(w.split()[2].rstrip(":") for w in warned) == sorted(
        refused & set(rt.settings.drafts)
    )
    bad = next(iter(refused & {"gemma", "q4_0"}))
    msg = f"draft '{bad}' cannot serve this target: built for"
    with pytest.raises(DraftIncompatible, match=msg) as e:
        rt.requests.check(ClientRequest(prompt="Hello", draft=bad, max_tokens=4))
    assert e.value.param == "draft"
    with pytest.raises(DraftIncompatible, match=msg):
        rt.requests.check(ClientRequest(prompt="Hello", policy=f"fixed:{bad}", max_tokens=4))
    prompt = rt.requests.prompt_tokens("Hello")
    with pytest.raises(DraftIncompatible, match=msg):
        rt.generate(prompt, SamplingParams(max_tokens=4, temperature=0), draft=bad)
    for action in (rt.draft_admin.load_draft, rt.draft_admin.pin):
        with pytest.raises(DraftIncompatible, match=msg):
            action(bad)
    rt.draft_admin.evict_draft(bad)  # never loaded: nothing to do, no error
    rt.draft_admin.pin(bad, False)
    # The rest of the pool serves, losslessly.
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef fib("
    prompt = rt.requests.prompt_tokens(text)
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = rt.generate(prompt, params, draft="none")
    for draft in ("auto", *sorted(served)):
        gen = rt.generate(prompt, params, draft=draft)
        assert gen.token_ids == plain.token_ids, draft
        assert set(gen.drafts_used) <= served, draft


@pytest.mark.parametrize(
    "target_file,fingerprint,refused,served",
    [
        (TARGET_FILE, _smol, {"gemma", "ds-gemma", "ds-old"}, {"prompt-lookup", "q4_0", "ds-smol"}),
        (GEMMA_FILE, _gemma, {"q4_0", "ds-smol", "ds-old"}, {"prompt-lookup", "gemma", "ds-gemma"}),
    ],
    ids=["smollm2-target", "gemma-target"],
)
def test_target_leaves_the_other_familys_drafts_out(
    pool, caplog, target_file, fingerprint, refused, served
):
    caplog.set_level(logging.WARNING, logger="memspec.runtime")
    rt = _runtime(pool, target_file)
    try:
        assert rt.target_tokenizer == fingerprint()
        _check_refused(rt, refused, served, caplog)
    finally:
        rt.close()


# --- end to end ------------------------------------------------------------------------------


def test_daemon_answers_400_and_goes_on(tmp_path):
    """A real daemon on the SmolLM2 target with a Gemma model draft in its pool."""
    import openai

    require_testbed()
    assert _gemma_path() == REAL_DATA_DIR / "models" / GEMMA_FILE
    mdir = tmp_path / "drafts"
    mdir.mkdir()
    for draft_id in ("prompt-lookup", "gemma"):
        (mdir / f"{draft_id}.toml").write_text(f'id = "{draft_id}"\n{MANIFESTS[draft_id]}')
    # The real data dir: the target's calibration is cached there.
    env = {"MEMSPEC_MANIFEST_DIR": str(mdir), "MEMSPEC_DATA_DIR": str(REAL_DATA_DIR)}
    with running(tmp_path, "lookup", keys=True, env=env) as daemon:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)
        ask = dict(model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ask, extra_body={"draft": "gemma"})
        err = e.value.body
        assert err["code"] == "draft_incompatible" and err["param"] == "draft"
        assert "llama tokenizer of 262144 tokens" in err["message"]
        r = client.completions.create(**ask)
        assert r.choices[0].text and r.usage.completion_tokens >= 1
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        rows = httpx.get(daemon.url + "/admin/drafts", headers=admin, timeout=30).json()
        row = next(d for d in rows["drafts"] if d["id"] == "gemma")
        assert row["compatible"] is False and "gpt2 tokenizer" in row["reason"]
        resp = httpx.post(
            daemon.url + "/admin/drafts/gemma/load", json={}, headers=admin, timeout=60
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "draft_incompatible"
