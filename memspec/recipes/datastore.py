"""Recipe "datastore": the corpus a retrieval draft searches (memspec.drafts.datastore),
tokenized, indexed and calibrated into its `.npz` file."""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from memspec.drafts.compat import fingerprint_of
from memspec.drafts.datastore import build_index, calibrate_alpha, save_index
from memspec.recipes import corpus


def build_datastore_file(recipe, src: Path, dst: Path, progress: bool = True) -> dict:
    """Recipe "datastore": corpus (target outputs on seed prompts + package text) → index file.

    `recipe` is a manifest BuildRecipe; `src` the target GGUF (it generates and tokenizes).
    """
    t0 = time.perf_counter()
    docs: list[list[int]] = []
    rows = corpus.select_seeds(recipe.domains, recipe.seeds_per_domain, recipe.seed)
    if rows and recipe.gen_tokens > 0:
        outs = corpus.generate_outputs(
            src, rows, recipe.gen_tokens, n_threads=corpus.default_threads(), progress=progress
        )
        docs += [r["tokens"] for r in outs]
    n_generated = sum(map(len, docs))
    if recipe.package_chars > 0:
        tok = corpus.Tokenizer(src)
        try:
            texts = corpus.package_texts(recipe.package_chars, seed=recipe.seed)
            for text in tqdm(texts, desc="corpus: package text", unit="file", disable=not progress):
                docs.append(tok.tokenize(text))
        finally:
            tok.close()
    index = build_index(docs, recipe.max_tokens)
    # Measure acceptance by match length on held-out answers (every 10th), indexing the rest.
    gen_docs = docs[: len(rows)] if rows and recipe.gen_tokens > 0 else []
    heldout = gen_docs[::10]
    rest = [d for i, d in enumerate(docs) if not (i < len(gen_docs) and i % 10 == 0)]
    alpha = calibrate_alpha(build_index(rest, recipe.max_tokens), heldout) if heldout else {}
    fingerprint = fingerprint_of(src)  # the token ids below are this tokenizer's
    meta = {
        "alpha_by_match": alpha,
        "tokenizer": fingerprint.to_dict() if fingerprint is not None else None,
        "source": src.name,
        "domains": recipe.domains,
        "seed_prompts": len(rows),
        "generated_tokens": n_generated,
        "package_tokens": sum(map(len, docs)) - n_generated,
    }
    save_index(dst, index, meta)  # no timestamps in it: the same inputs give the same bytes
    return {**meta, "build_s": round(time.perf_counter() - t0, 1)}
