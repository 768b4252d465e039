"""Measure one real model load: memory before, after loading, after its largest batches.

Run it in a fresh process (`python -m memspec.memory.probe FILE --n-ctx N --outputs R`, or
`python -m memspec.memory.probe --draft ID --n-ctx N --resident TARGET.gguf`) so
that allocator state left by earlier loads does not blur the delta. The model is loaded the
way the daemon loads it (memspec's llama.cpp backend, mmap off: a real copy into process
memory, not page cache), then driven like the engine drives it at its worst: the context is
prefilled to the end in n_batch chunks with one output row, then a batch asks for `outputs`
logit rows (k + 1 for a target, 1 for a draft). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from memspec.kv_cache import F16, KV_TYPES, KVCache
from memspec.memory.measure import MemorySample, sample


def measure_model(
    path: Path,
    n_ctx: int,
    outputs: int = 1,
    n_threads: int = 1,
    resident: Path | None = None,
    slots: int = 1,
    kv_cache: KVCache = F16,
) -> dict[str, Any]:
    """Memory deltas of loading and running `path`; `resident` is loaded first and kept.
    With `slots`, every sequence slot is filled, then one pass verifies `outputs` rows in each.

    With the target as `resident` the draft is measured as the daemon loads it: beside a
    resident model, with llama.cpp's code pages and one-time state already paid for.
    One thread by default: llama.cpp's worker threads spin, which on a shared box only slows.
    """
    from memspec.backends.base import BackendOptions, load_backend

    keep = None
    if resident is not None:
        keep = load_backend(resident, BackendOptions(n_ctx=256, n_threads=n_threads))
        keep.eval([1, 2, 3, 4], all_logits=True)
    else:
        from memspec.backends.llama_cpp import LlamaCppBackend  # noqa: F401 - map libllama now
    gc.collect()
    before = sample()
    options = BackendOptions(
        n_ctx=n_ctx,
        n_threads=n_threads,
        use_mmap=False,
        n_seq=slots,
        kv_cache=kv_cache,
        share_weights=False,  # its own copy, even of the resident model's file
    )
    be = load_backend(path, options)
    loaded = sample()
    # Prefill to the end of the context (the largest attention the engine can ask for), leaving
    # room for the final batch; token ids are arbitrary but valid.
    tail = max(outputs, 1) + 1
    prompt = [100 + (i * 37) % 5000 for i in range(be.n_ctx - tail)]
    for slot in be.slots:
        slot.eval(prompt, all_logits=False)
    if slots > 1:
        be.eval_many([(slot, [42] * max(outputs, 1), max(outputs, 1)) for slot in be.slots])
    else:
        be.eval([42] * max(outputs, 1), all_logits=True)
    ran = sample()
    be.close()
    if keep is not None:
        keep.close()
    return {
        "file": path.name,
        "n_ctx": n_ctx,
        "outputs": outputs,
        "slots": slots,
        "kv_cache": {
            "type_k": kv_cache.type_k,
            "type_v": kv_cache.type_v,
            "fa": kv_cache.flash_attn,
        },
        "resident": resident.name if resident else None,
        "at_load": loaded.delta(before),
        "steady": ran.delta(before),
        "baseline": _as_dict(before),
    }


def _warm_head() -> None:
    """torch's and safetensors' one-time costs, paid on a tiny head (a process pays them once,
    whichever head it loads; a real head loaded and closed here would leave its freed tensors
    in the C heap for the measured load to reuse)."""
    import tempfile

    import numpy as np
    import torch

    from memspec.drafts.head import head_net, load_head_net, save_head

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "warm.safetensors"
        save_head(
            head_net(8, 8, torch.zeros(4, 8)),
            np.arange(4),
            path,
            {"n_embd": 8, "hidden": 8, "n_vocab": 4},
        )
        load_head_net(path)


def measure_draft(
    draft_id: str,
    n_ctx: int,
    resident: Path | None = None,
    manifest_dir: Path | None = None,
    n_threads: int = 1,
) -> dict[str, Any]:
    """Measure a draft of the pool by id. Model drafts are driven like measure_model; other
    kinds (prompt lookup, datastores) are measured right after loading, beside `resident`."""
    from memspec.backends.base import BackendOptions, load_backend
    from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
    from memspec.drafts.registry import draft_kind, instantiate
    from memspec.paths import models_dir

    m = load_manifests(manifest_dir or DEFAULT_MANIFEST_DIR)[draft_id]
    kind = draft_kind(m.kind)
    if kind.sizing == "gguf":  # a model file: driven like a target
        r = measure_model(m.model_path(models_dir()), n_ctx, 1, n_threads, resident)
        return {"id": draft_id, "kind": m.kind, **r}
    opts = BackendOptions(n_ctx=n_ctx, n_threads=n_threads)
    # A head drafts from the resident target's features (it must be given one).
    keep_opts = BackendOptions(n_ctx=256, features=kind.needs_target_features)
    keep = load_backend(resident, keep_opts) if resident else None
    # The kind's code is imported once per process, and is not measured. (A head's loaded
    # then closed tensors would stay in the C heap and the measured load reuse them.)
    if kind.needs_target_features:
        _warm_head()
    else:
        instantiate(m, opts, "llama_cpp", target_backend=keep).close()
    gc.collect()
    before = sample()
    draft = instantiate(m, opts, "llama_cpp", target_backend=keep)
    loaded = sample()
    draft.close()
    if keep is not None:
        keep.close()
    d = loaded.delta(before)
    return {"id": draft_id, "kind": m.kind, "n_ctx": n_ctx, "at_load": d, "steady": d}


def _as_dict(s: MemorySample) -> dict[str, int | None]:
    return {"rss": s.rss, "uss": s.uss, "nvmap_used": s.nvmap_used, "cuda_used": s.cuda_used}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memspec.memory.probe", description=__doc__)
    ap.add_argument("file", help="a GGUF file, or a draft id of the pool with --draft")
    ap.add_argument("--draft", action="store_true", help="`file` is a draft id (drafts/*.toml)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--outputs", type=int, default=1, help="logit rows of the last batch")
    ap.add_argument("--n-threads", type=int, default=1)
    ap.add_argument("--resident", type=Path, help="model loaded first and kept (the target)")
    ap.add_argument("--slots", type=int, default=1, help="sequence slots (batched decoding)")
    ap.add_argument("--kv-type-k", choices=KV_TYPES, default="f16")
    ap.add_argument("--kv-type-v", choices=KV_TYPES, default="f16")
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--swa-full", action="store_true", help="full-size sliding-window layers")
    args = ap.parse_args(argv)
    if args.draft:
        r = measure_draft(args.file, args.n_ctx, args.resident, n_threads=args.n_threads)
    else:
        kv = KVCache(args.kv_type_k, args.kv_type_v, args.flash_attn, args.swa_full)
        r = measure_model(
            Path(args.file), args.n_ctx, args.outputs, args.n_threads, args.resident, args.slots, kv
        )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
