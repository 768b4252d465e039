"""Recipe "layers": a GGUF with a subset of blocks loads in llama.cpp and is lossless as a draft."""

from __future__ import annotations

import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.model import ModelDraft
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import speculative_generate
from memspec.paths import models_dir
from memspec.recipes.layers import write_layer_subset

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

SOURCE = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEEP = [0, 1, 2, 3, 28, 29]


@pytest.fixture(scope="module")
def subset_file(tmp_path_factory):
    src = models_dir() / SOURCE
    if not src.is_file():
        pytest.fail(f"{src} missing: run scripts/setup.sh", pytrace=False)
    dst = tmp_path_factory.mktemp("layers") / "l6.gguf"
    write_layer_subset(src, dst, KEEP)
    return dst


def test_subset_loads_with_renumbered_blocks(subset_file):
    import gguf

    reader = gguf.GGUFReader(str(subset_file))
    assert int(reader.fields["llama.block_count"].contents()) == len(KEEP)
    blocks = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")}
    assert blocks == set(range(len(KEEP)))
    src = gguf.GGUFReader(str(models_dir() / SOURCE))
    # Everything but the dropped blocks is kept: tokenizer, template, embeddings, head.
    assert str(reader.fields["tokenizer.chat_template"].contents()) == str(
        src.fields["tokenizer.chat_template"].contents()
    )
    src_other = {t.name for t in src.tensors if not t.name.startswith("blk.")}
    assert src_other <= {t.name for t in reader.tensors}
    # Block 4 of the subset is block 28 of the source, byte for byte.
    a = next(t for t in reader.tensors if t.name == "blk.4.attn_q.weight")
    b = next(t for t in src.tensors if t.name == "blk.28.attn_q.weight")
    assert a.data.tobytes() == b.data.tobytes()

    be = load_backend(subset_file, BackendOptions(n_ctx=128, n_threads=1))
    try:
        assert be.n_layers == len(KEEP)
        assert be.tokenize("hello world", add_bos=False) == [28120, 905]
        assert be.eval(be.tokenize("The capital of France is")).shape[1] == be.n_vocab
    finally:
        be.close()


def test_bad_keep_layers(tmp_path):
    with pytest.raises(ValueError, match="distinct indices"):
        write_layer_subset(models_dir() / SOURCE, tmp_path / "x.gguf", [0, 0, 99])


def test_subset_draft_is_lossless(subset_file):
    # One thread each: on a shared, busy CPU two threads wait on each other at every barrier.
    target = load_backend(
        models_dir() / "smollm2-135m-f32.gguf", BackendOptions(n_ctx=256, n_threads=1)
    )
    draft = ModelDraft("l6", load_backend(subset_file, BackendOptions(n_ctx=256, n_threads=1)))
    params = SamplingParams(max_tokens=16)
    try:
        for text in ["Write a haiku about rain.", "List three primary colors."]:
            prompt = target.tokenize(
                target.chat_prompt([{"role": "user", "content": text}]), special=True
            )
            target.reset()
            ref = speculative_generate(target, prompt, params, FixedPolicy(None, 0)).token_ids
            assert ref
            for k in (1, 4):
                target.reset()
                gen = speculative_generate(target, prompt, params, FixedPolicy(draft, k))
                assert gen.token_ids == ref, f"k={k} diverged"
                assert gen.proposed > 0
    finally:
        draft.close()
        target.close()
