"""Recipe "distill": a small draft trained to match the target's next-token distribution.

The student is the target cut down: its embeddings (frozen; SmolLM2 ties them to the output
head), the blocks named in `keep_layers` and its final norm. It is trained with torch on
KL(target ‖ student) over every position of a corpus:
- the target's own greedy answers to seed prompts (chat template and prompt included, so the
  student sees what a draft sees when serving), for the recipe's `domains`;
- package text (stdlib source, pydoc prose), for code.
The target's distribution comes from llama.cpp on the target GGUF itself, the same numbers the
verifier uses. The student is written back as a GGUF (the target's metadata and tokenizer,
llama.cpp's rotary Q/K row order) and quantized with llama.cpp, so it serves like any draft.

Resumable: a checkpoint every `ckpt_every` steps under cache/distill/<recipe key>/; a rerun
continues from the last one. Deterministic for a given seed and thread count: the batch at step
s is drawn from the seed, and torch is seeded.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from memspec.paths import cache_dir
from memspec.recipes import corpus
from memspec.recipes.layers import write_layer_subset
from memspec.recipes.training import batch_order, heldout_split, seeded_torch, train

# transformers' Llama parameter names -> GGUF tensor names (llama.cpp's convert_hf_to_gguf).
_BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary row order -> llama.cpp's (the converter's permute; transformers undoes it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """A transformers Llama model's weights as GGUF tensors (names, layout, F32)."""
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        arr = t.detach().to("cpu").float().numpy()
        if name == "model.norm.weight":
            out["output_norm.weight"] = arr
            continue
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = arr
            continue
        if not name.startswith("model.layers."):
            continue  # lm_head: tied to the embeddings
        i, rest = name[len("model.layers.") :].split(".", 1)
        if rest == "self_attn.q_proj.weight":
            arr = _rope_permute(arr, n_head)
        elif rest == "self_attn.k_proj.weight":
            arr = _rope_permute(arr, n_kv)
        out[f"blk.{i}.{_BLOCK_NAMES[rest]}"] = np.ascontiguousarray(arr)
    return out


def load_student(target: Path, keep_layers: list[int]) -> Any:
    """The target in transformers, cut to `keep_layers`, embeddings frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    from memspec.backends.torch_hf import _quiet_load

    with _quiet_load():
        model = AutoModelForCausalLM.from_pretrained(
            str(target.parent), gguf_file=target.name, dtype=torch.float32, local_files_only=True
        )
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep_layers])
    for new, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new
    model.config.num_hidden_layers = len(keep_layers)
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = [model.config.layer_types[i] for i in keep_layers]
    model.model.embed_tokens.weight.requires_grad_(False)
    model.config.use_cache = False
    return model


def training_sequences(recipe: Any, teacher: Any, progress: bool) -> tuple[list, list[str]]:
    """Token sequences of at most seq_len (prompt + answer, or a slice of package text)."""
    seqs: list[list[int]] = []
    domains: list[str] = []
    rows = corpus.select_seeds(recipe.domains, recipe.seeds_per_domain, recipe.seed)
    if rows and recipe.gen_tokens > 0:
        outs = corpus.generate_outputs(
            Path(teacher.path),
            rows,
            recipe.gen_tokens,
            corpus.default_threads(),
            progress=progress,
            teacher=recipe.teacher,
        )
        for r in outs:
            chat = teacher.chat_prompt([{"role": "user", "content": r["prompt"]}])
            toks = teacher.tokenize(chat, special=True) + r["tokens"]
            seqs.append(toks[: recipe.seq_len])
            domains.append(r["domain"])
    if recipe.package_chars > 0:
        for text in corpus.package_texts(recipe.package_chars, seed=recipe.seed):
            toks = teacher.tokenize(text, add_bos=False)
            for s in range(0, len(toks) - 16, recipe.seq_len):
                seqs.append(toks[s : s + recipe.seq_len])
                domains.append("package")
    return seqs, domains


def _batch(seqs: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    n = max(map(len, seqs))
    ids = np.full((len(seqs), n), pad, dtype=np.int64)
    mask = np.zeros((len(seqs), n), dtype=bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    return ids, mask


def _teacher_logprobs(teacher: Any, seqs: list[list[int]], n: int) -> np.ndarray:
    """log softmax of the target's logits at every position, padded to n positions."""
    out = np.zeros((len(seqs), n, teacher.n_vocab), dtype=np.float32)
    for i, s in enumerate(seqs):
        teacher.reset()
        logits = teacher.eval(s, all_logits=True).astype(np.float32)
        logits -= logits.max(axis=-1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        out[i, : len(s)] = logits
    return out


def agreement(
    model: Any, teacher: Any, seqs: list[list[int]], domains: list[str]
) -> dict[str, float]:
    """Top-1 agreement of student and target per domain on held-out sequences (answer part)."""
    import torch

    hit: dict[str, int] = {}
    seen: dict[str, int] = {}
    model.eval()
    with torch.no_grad():
        for s, d in zip(seqs, domains, strict=True):
            teacher.reset()
            t_top = teacher.eval(s, all_logits=True).argmax(axis=-1)
            s_top = model(torch.tensor([s])).logits[0].argmax(-1).numpy()
            hit[d] = hit.get(d, 0) + int((t_top == s_top).sum())
            seen[d] = seen.get(d, 0) + len(s)
    model.train()
    out = {d: round(hit[d] / seen[d], 4) for d in sorted(seen)}
    out["all"] = round(sum(hit.values()) / max(sum(seen.values()), 1), 4)
    return out


def export_gguf(model: Any, target: Path, keep_layers: list[int], dst: Path) -> None:
    """The student as a GGUF: the target's metadata and tokenizer, the student's tensors."""
    write_layer_subset(target, dst, keep_layers, overrides=gguf_tensors(model))


def build_distilled_file(
    recipe: Any, src: Path, dst: Path, key: str, progress: bool = True
) -> dict[str, Any]:
    """Recipe "distill": train (or resume) the student, export it, quantize it to recipe.ftype."""
    from memspec.backends.base import BackendOptions, load_backend
    from memspec.recipes.build import quantize

    t0 = time.perf_counter()
    torch, threads = seeded_torch("distill", recipe.seed)
    keep = recipe.keep_layers or [0]
    work = cache_dir() / "distill" / key[:16]
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoint.pt"

    options = BackendOptions(n_ctx=recipe.seq_len + 8, n_threads=threads)
    teacher = load_backend(src, options, kind=recipe.teacher)
    try:
        seqs, domains = training_sequences(recipe, teacher, progress)
        if not seqs:
            raise ValueError("recipe 'distill': empty corpus (no seed prompts, no package text)")
        held, train_ids = heldout_split(len(seqs), recipe.eval_seqs)
        order = batch_order(len(train_ids), recipe.seed, recipe.steps, recipe.batch_size)
        model = load_student(src, keep)

        def loss_at(step: int) -> Any:
            batch = [seqs[train_ids[j]] for j in order[step]]
            ids, mask = _batch(batch, pad=0)
            t_logp = torch.from_numpy(_teacher_logprobs(teacher, batch, ids.shape[1]))
            m = torch.from_numpy(mask)
            s_logp = torch.log_softmax(model(torch.from_numpy(ids)).logits, dim=-1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
            return (kl * m).sum() / m.sum()

        losses = train(
            model,
            recipe,
            ckpt,
            loss_at,
            f"distill {len(keep)} layers",
            progress,
            kept=lambda name: "embed_tokens" not in name,  # frozen: the target's own
        )
        agree = agreement(model, teacher, [seqs[i] for i in held], [domains[i] for i in held])
    finally:
        teacher.close()

    f32 = dst.with_name(dst.name + ".f32")
    export_gguf(model, src, keep, f32)
    if recipe.ftype == "F32":
        f32.replace(dst)
    else:
        quantize(f32, dst, recipe.ftype)
        f32.unlink()
    report = {
        "keep_layers": keep,
        "steps": recipe.steps,
        "train_tokens": int(sum(len(seqs[train_ids[j]]) for j in order.ravel())),
        "sequences": len(seqs),
        "kl_first": losses[0] if losses else None,
        "kl_last": float(np.mean(losses[-10:])) if losses else None,
        "heldout_top1_agreement": agree,
        "threads": threads,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    (work / "report.json").write_text(json.dumps({**report, "kl": losses}, indent=1))
    with contextlib.suppress(OSError):
        ckpt.unlink()  # done: the exported file is the result; a rebuild starts over
    return report
