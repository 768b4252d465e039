"""Recipe "head": train an EAGLE-style head (memspec.drafts.head) on the target's features.

1. Corpus: the sequences the distill recipe uses (the target's own greedy answers to seed
   prompts, chat template included, plus package text), cut to `seq_len`.
2. Features: the target (the GGUF itself, features on; in llama.cpp, or with `teacher =
   "torch"` through transformers in float32) evaluates every sequence once; each position's
   feature and the target's argmax are kept (cached under cache/head/<recipe key>/, so a
   resumed build does not evaluate again).
3. Sub-vocabulary: the `subvocab` tokens the target predicts most often over the training
   positions; their output rows (and embeddings, if untied) are read from the GGUF.
4. Training (torch, CPU): from (f_t, x_{t+1}) predict f_{t+1}; loss = KL of the target's
   distribution over the sub-vocabulary (softmax of f_{t+1} through its rows) to the head's,
   plus a smooth-L1 regression on the feature; a second step from the head's own prediction
   (x_{t+2}, target f_{t+2}) trains what drafting does at k > 1. Batches of positions drawn
   from the seed for each step, AdamW, warm-up + cosine; a checkpoint every `ckpt_every`
   steps (a rerun resumes there); deterministic for a seed and thread count.
5. Report: on held-out sequences, per domain, top-1 agreement of the head's first step with
   the target, the replayed α₁ (positions where the text is the target's own choice, as when
   serving) and α₂ given α₁, and the sub-vocabulary's coverage of the target's choices.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from memspec.paths import cache_dir
from memspec.recipes.distill import training_sequences
from memspec.recipes.training import batch_order, heldout_split, seeded_torch, train


def extract_features(
    teacher: Any, seqs: list[list[int]], path: Path, progress: bool
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sequence: the target's feature at every position (float32, L × n_embd) and its
    argmax there (the token it predicts next); cached in `path`."""
    if path.is_file():
        with np.load(path) as z:
            lengths = z["lengths"]
            if list(lengths) == [len(s) for s in seqs]:
                cuts = np.cumsum(lengths)[:-1]
                return np.split(z["features"], cuts), np.split(z["argmax"], cuts)
    from memspec.backends.torch_hf import TorchBackend

    if isinstance(teacher, TorchBackend):
        feats, tops = _batched_features(teacher.hf_model, seqs, progress)
    else:
        feats, tops = [], []
        for s in tqdm(seqs, desc="head: target features", unit="seq", disable=not progress):
            teacher.reset()
            logits = teacher.eval(s, all_logits=True, copy=False)
            tops.append(logits.argmax(axis=1).astype(np.int64))
            feats.append(np.array(teacher.last_features(), dtype=np.float32))
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        features=np.concatenate(feats),
        argmax=np.concatenate(tops),
        lengths=np.array([len(s) for s in seqs]),
    )
    tmp.replace(path)
    return feats, tops


def _batched_features(
    model: Any, seqs: list[list[int]], progress: bool, batch: int = 8
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """extract_features through transformers: sequences of similar length a batch at a time
    (the torch Backend feeds one sequence token by token; here ~10x faster), the features read
    as the output layer's input, as TorchBackend reads them when serving."""
    import torch

    feats: list[Any] = [None] * len(seqs)
    tops: list[Any] = [None] * len(seqs)
    captured: dict[str, Any] = {}
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _module, args: captured.update(features=args[0])
    )
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding
    try:
        for start in tqdm(
            range(0, len(order), batch),
            desc="head: target features",
            unit="batch",
            disable=not progress,
        ):
            idx = order[start : start + batch]
            # Padded on the right: in a causal model no position sees the padding after it.
            ids = torch.zeros((len(idx), max(len(seqs[i]) for i in idx)), dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, : len(seqs[i])] = torch.tensor(seqs[i])
            with torch.no_grad():
                top = model(input_ids=ids).logits.argmax(-1)
            for j, i in enumerate(idx):
                n = len(seqs[i])
                feats[i] = captured["features"][j, :n].float().numpy().copy()
                tops[i] = top[j, :n].numpy().astype(np.int64)
    finally:
        hook.remove()
    return feats, tops


def output_rows(src: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The target's output-matrix rows for `ids` and, when its output is not tied to the
    embeddings, their embedding rows too (float32, dequantized from the GGUF)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    tensors = {t.name: t for t in reader.tensors}

    def rows(name: str) -> np.ndarray:
        t = tensors[name]
        data = np.asarray(t.data[ids])
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return data.astype(np.float32)
        return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)

    embd = rows("token_embd.weight")
    if "output.weight" in tensors:
        return rows("output.weight"), embd
    return embd, None


def rank_subvocab(
    tops: list[np.ndarray], seqs: list[list[int]], n: int, n_vocab: int
) -> np.ndarray:
    """The n tokens the target predicts most often (then the corpus's most frequent, then by
    id), in that order."""
    predicted = np.bincount(np.concatenate(tops), minlength=n_vocab)
    seen = np.bincount(np.concatenate([np.asarray(s) for s in seqs]), minlength=n_vocab)
    # lexsort: last key first; ties broken by id (ascending) for determinism
    order = np.lexsort((np.arange(n_vocab), -seen, -predicted))
    return order[: min(n, n_vocab)]


class Positions:
    """Training examples: position t of a sequence with t + 2 inside it."""

    def __init__(self, seqs: list[list[int]], feats: list[np.ndarray], index: list[int]):
        self.starts, self.seq_of = [], []
        offset = np.cumsum([0] + [len(f) for f in feats])
        self.features = np.concatenate(feats)
        self.tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
        for i in index:
            t = np.arange(len(seqs[i]) - 2)
            self.starts.append(offset[i] + t)
        self.starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        g = self.starts[rows]  # global row of f_t
        return {
            "f0": self.features[g],
            "x1": self.tokens[g + 1],
            "f1": self.features[g + 1],
            "x2": self.tokens[g + 2],
            "f2": self.features[g + 2],
        }


def head_loss(net: Any, b: dict[str, Any], sub_index: Any) -> Any:
    """KL(target ‖ head) over the sub-vocabulary + smooth-L1 on the feature, two steps."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    f = b["f0"]
    for x, target in ((b["x1"], b["f1"]), (b["x2"], b["f2"])):
        f = net(f, sub_index[x])
        with torch.no_grad():
            p = torch.softmax(net.logits(target), -1)
        log_q = torch.log_softmax(net.logits(f), -1)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - log_q)).sum(-1).mean()
        total = total + kl + F.smooth_l1_loss(f, target)
    return total


def replay_report(
    net: Any,
    seqs: list[list[int]],
    feats: list[np.ndarray],
    tops: list[np.ndarray],
    domains: list[str],
    index: list[int],
    sub_ids: np.ndarray,
    sub_index: Any,
) -> dict[str, Any]:
    """Per domain on held-out sequences: top-1 agreement of the first step, replayed α₁ and
    α₂ given α₁ (see module doc), and the sub-vocabulary's coverage."""
    import torch

    counts: dict[str, np.ndarray] = {}
    dtype = net.out_rows.dtype  # the report measures the head as it is saved (float16)
    in_sub = np.zeros(len(sub_index), dtype=bool)
    in_sub[sub_ids] = True
    with torch.no_grad():
        for i in index:
            s, f, top = np.asarray(seqs[i]), feats[i], tops[i]
            if len(s) < 3:
                continue
            t = np.arange(len(s) - 2)
            f1 = net(torch.from_numpy(f[t]).to(dtype), sub_index[torch.from_numpy(s[t + 1])])
            first = sub_ids[net.logits(f1).argmax(-1).numpy()]
            f2 = net(f1, sub_index[torch.from_numpy(s[t + 2])])
            second = sub_ids[net.logits(f2).argmax(-1).numpy()]
            agree = first == top[t + 1]
            own = s[t + 1] == top[t]  # the text follows the target here, as when serving
            chain = own & agree & (s[t + 2] == top[t + 1])
            c = counts.setdefault(domains[i], np.zeros(7))
            c += [
                len(t),
                agree.sum(),
                own.sum(),
                (own & agree).sum(),
                chain.sum(),
                (chain & (second == top[t + 2])).sum(),
                in_sub[top[t + 1]].sum(),
            ]
    out: dict[str, Any] = {}
    for d, c in sorted(counts.items()) + [("all", sum(counts.values(), np.zeros(7)))]:
        out[d] = {
            "positions": int(c[0]),
            "top1_agreement": round(c[1] / max(c[0], 1), 4),
            "alpha1": round(c[3] / max(c[2], 1), 4),
            "alpha2_given_alpha1": round(c[5] / max(c[4], 1), 4),
            "subvocab_coverage": round(c[6] / max(c[0], 1), 4),
        }
    return out


def build_head_file(
    recipe: Any, src: Path, dst: Path, key: str, progress: bool = True
) -> dict[str, Any]:
    """Recipe "head": features, sub-vocabulary, training (or resume), artifact at `dst`."""
    from memspec.backends.base import BackendOptions, load_backend
    from memspec.drafts.compat import fingerprint_of
    from memspec.drafts.head import head_net, save_head

    t0 = time.perf_counter()
    torch, threads = seeded_torch("head", recipe.seed)
    work = cache_dir() / "head" / key[:16]
    work.mkdir(parents=True, exist_ok=True)

    options = BackendOptions(n_ctx=recipe.seq_len + 8, n_threads=threads, features=True)
    teacher = load_backend(src, options, kind=recipe.teacher)
    try:
        seqs, domains = training_sequences(recipe, teacher, progress)
        if not seqs:
            raise ValueError("recipe 'head': empty corpus (no seed prompts, no package text)")
        feats, tops = extract_features(teacher, seqs, work / "features.npz", progress)
        n_embd, n_vocab = teacher.n_embd, teacher.n_vocab
        target_name = teacher.metadata.get("general.name", src.stem)
    finally:
        teacher.close()

    held, train_ids = heldout_split(len(seqs), recipe.eval_seqs)
    sub_ids = rank_subvocab(
        [tops[i] for i in train_ids], [seqs[i] for i in train_ids], recipe.subvocab, n_vocab
    )
    out_rows, in_rows = output_rows(src, sub_ids)
    net = head_net(
        n_embd,
        recipe.hidden,
        torch.from_numpy(out_rows),
        None if in_rows is None else torch.from_numpy(in_rows),
    )
    sub_index = torch.full((n_vocab,), len(sub_ids), dtype=torch.int64)
    sub_index[torch.from_numpy(sub_ids)] = torch.arange(len(sub_ids))

    data = Positions(seqs, feats, train_ids)
    if len(data.starts) == 0:
        raise ValueError("recipe 'head': no training positions (sequences too short)")
    order = batch_order(len(data.starts), recipe.seed, recipe.steps, recipe.batch_size)

    def loss_at(step: int) -> Any:
        batch = {k: torch.from_numpy(v) for k, v in data.batch(order[step]).items()}
        return head_loss(net, batch, sub_index)

    losses = train(net, recipe, work / "checkpoint.pt", loss_at, "head", progress)
    net.eval().half()
    report_held = replay_report(net, seqs, feats, tops, domains, held, sub_ids, sub_index)
    fingerprint = fingerprint_of(src)
    save_head(
        net,
        sub_ids,
        dst,
        {
            "n_embd": n_embd,
            "n_vocab": n_vocab,
            "hidden": recipe.hidden,
            "subvocab": len(sub_ids),
            "target": src.name,
            "target_name": target_name,
            "tokenizer": fingerprint.to_dict() if fingerprint is not None else None,
        },
    )
    report = {
        "subvocab": len(sub_ids),
        "hidden": recipe.hidden,
        "steps": recipe.steps,
        "train_positions": int(len(data.starts)),
        "sequences": len(seqs),
        "loss_first": losses[0] if losses else None,
        "loss_last": float(np.mean(losses[-10:])) if losses else None,
        "heldout": report_held,
        "threads": threads,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    (work / "report.json").write_text(json.dumps({**report, "loss": losses}, indent=1))
    with contextlib.suppress(OSError):
        (work / "checkpoint.pt").unlink()  # done: the artifact is the result; a rebuild starts over
    return report
