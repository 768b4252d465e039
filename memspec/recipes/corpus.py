"""Offline corpora for building drafts: the target's own outputs and text shipped in packages.

(a) Target outputs: seed prompts (drafts/seeds/prompts.jsonl, never MT-Bench) decoded greedily
    by the target with llama.cpp, many sequences per batch (continuous batching: a finished
    sequence's slot takes the next prompt), because one 135M step costs ~20 ms whether it
    carries 1 or 16 tokens on a CPU. Each finished generation is appended to a JSONL cache at
    once, so an interrupted build resumes where it stopped. A recipe with `teacher = "torch"`
    has them answered through transformers in bfloat16 instead (TorchGreedy), cached apart.
(b) Package text: Python source of the standard library (and the pydoc topic help), openly
    licensed and present offline on every machine that runs this package.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import itertools
import json
import random
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from memspec.backends.chat import ChatTemplate, resolve_chat_template
from memspec.config import build_threads
from memspec.paths import cache_dir

SEEDS_FILE = Path(__file__).resolve().parent.parent.parent / "drafts" / "seeds" / "prompts.jsonl"


def load_seeds(path: Path = SEEDS_FILE, domains: list[str] | None = None) -> list[dict[str, str]]:
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if not domains or r["domain"] in domains]


def select_seeds(
    domains: list[str] | None, per_domain: int | None, seed: int, path: Path = SEEDS_FILE
) -> list[dict[str, str]]:
    """A deterministic subset: `per_domain` prompts of each domain, chosen with `seed`."""
    if per_domain is None:
        return load_seeds(path, domains)
    rows = load_seeds(path)
    rng = random.Random(seed)
    groups = []
    # Shuffle every domain, in a fixed order, whichever are asked for: a domain's choice must
    # not depend on the others (drafts built from different domain sets share the answers).
    for d in sorted({r["domain"] for r in rows}):
        group = [r for r in rows if r["domain"] == d]
        rng.shuffle(group)
        if not domains or d in domains:
            groups.append(group[:per_domain])
    # Round-robin over domains, so a size cap on the datastore keeps the domains balanced.
    return [r for batch in itertools.zip_longest(*groups) for r in batch if r is not None]


@dataclass
class _Slot:
    row: dict[str, str]
    prompt_len: int
    out: list[int]
    seq: int
    limit: int  # new tokens wanted


class BatchedGreedy:
    """Greedy decoding of many prompts at once on one llama.cpp context (one seq id per slot)."""

    def __init__(
        self, model_path: Path, batch: int = 48, n_ctx_per_seq: int = 512, n_threads: int = 1
    ):
        import llama_cpp

        self._lc = llama_cpp
        self.batch = batch
        self.n_ctx_per_seq = n_ctx_per_seq
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            # The Llama object gives the model, tokenizer and metadata; we decode on our own
            # multi-sequence context below.
            self.llm = llama_cpp.Llama(
                model_path=str(model_path),
                n_ctx=64,
                n_threads=n_threads,
                use_mmap=False,
                verbose=False,
            )
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = batch * n_ctx_per_seq
        p.n_batch = max(512, batch)
        p.n_ubatch = max(512, batch)
        p.n_seq_max = batch
        p.n_threads = n_threads
        p.n_threads_batch = n_threads
        # One KV stream per sequence: with a unified cache every token attends over all
        # sequences' cells (masked), which makes big batches slower than small ones.
        p.kv_unified = False
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = self.llm.n_vocab()
        self.n_batch = p.n_batch
        self.cbatch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        eos = {self.llm.token_eos()}
        eot = llama_cpp.llama_vocab_eot(self.llm._model.vocab)
        if eot >= 0:
            eos.add(eot)
        self.eos = eos
        # The target's own chat template, resolved as the runtime resolves it: a corpus of
        # answers to prompts the target never sees in serving would index the wrong text.
        self.template = chat_template_of(model_path)
        self.adds_bos = self.llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
        bos = self.llm.token_bos()
        self.bos_text = self.llm._model.token_get_text(bos) if bos >= 0 else ""
        self.eos_text = self.llm._model.token_get_text(self.llm.token_eos())

    def chat_tokens(self, prompt: str) -> list[int]:
        text = self.template.render(
            [{"role": "user", "content": prompt}], self.bos_text, self.eos_text, self.adds_bos
        )
        return self.llm.tokenize(text.encode(), add_bos=True, special=True)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode("utf-8", errors="replace")

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """entries: (token, pos, seq, want_logits). Returns {entry index: argmax token}."""
        out: dict[int, int] = {}
        b = self.cbatch
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = want
            if not any(e[3] for e in chunk):
                b.logits[len(chunk) - 1] = True  # llama.cpp wants at least one output
            rc = self._lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with {rc}")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    ptr = self._lc.llama_get_logits_ith(self.ctx, i)
                    row = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
                    )
                    out[start + i] = int(np.argmax(row))
        return out

    def run(self, rows: list[dict[str, str]], max_tokens: int) -> Iterator[tuple[dict, list[int]]]:
        """Yield (row, output tokens) as each generation finishes (order not guaranteed)."""
        queue = list(rows)
        queue.reverse()
        free = list(range(self.batch))
        slots: dict[int, _Slot] = {}
        pending: list[tuple[int, int, int, bool]] = []  # next decode's entries
        owners: list[int] = []  # seq of each entry that wants logits, in order
        while queue or slots:
            # Fill free slots with new prompts. Each prompt is prefilled on its own, all but its
            # last token, so every shared step holds exactly one token per sequence: llama.cpp
            # splits a batch mixing lengths across sequences into many small ones.
            while free and queue:
                row = queue.pop()
                toks = self.chat_tokens(row["prompt"])
                room = self.n_ctx_per_seq - max_tokens
                toks = toks[-room:] if len(toks) > room else toks
                seq = free.pop()
                slots[seq] = _Slot(row, len(toks), [], seq, int(row.get("max_tokens", max_tokens)))
                if len(toks) > 1:
                    self._decode([(t, i, seq, False) for i, t in enumerate(toks[:-1])])
                pending.append((toks[-1], len(toks) - 1, seq, True))
                owners.append(seq)
            # Sequences in ascending id order: llama.cpp splits a batch whose sequence ids are
            # out of order into one small batch per sequence (7x slower here).
            pending.sort(key=lambda e: (e[2], e[1]))
            owners = [e[2] for e in pending if e[3]]
            want_idx = [i for i, e in enumerate(pending) if e[3]]
            picks = self._decode(pending)
            pending = []
            next_owners: list[int] = []
            for idx, seq in zip(want_idx, owners, strict=True):
                s = slots[seq]
                tok = picks[idx]
                done = tok in self.eos
                if not done:
                    s.out.append(tok)
                if done or len(s.out) >= s.limit:
                    self._lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
                    del slots[seq]
                    free.append(seq)
                    yield s.row, s.out
                else:
                    pending.append((tok, s.prompt_len + len(s.out) - 1, seq, True))
                    next_owners.append(seq)
            owners = next_owners

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._lc.llama_batch_free(self.cbatch)
            self._lc.llama_free(self.ctx)
            self.ctx = None
        self.llm.close()


class TorchGreedy:
    """Greedy answers through transformers (the GGUF dequantized into torch), a batch of
    prompts of similar length at a time, the matmuls in bfloat16 (autocast): on a CPU with
    bfloat16 units several times the answers per second of llama.cpp at F32 (docs/drafts.md,
    "Heads"). A near-tie can go the other way in bfloat16, so this is the target's text, not
    its exact F32 choices: for recipes that label every position with the target's own F32
    output (head), not for ones that replay its choices."""

    def __init__(
        self, model_path: Path, batch: int = 64, n_ctx_per_seq: int = 512, n_threads: int = 1
    ):
        from memspec.backends.base import BackendOptions, load_backend

        opts = BackendOptions(n_ctx=n_ctx_per_seq, n_threads=n_threads)
        self.backend = load_backend(model_path, opts, kind="torch")
        self.batch = batch
        self.n_ctx_per_seq = n_ctx_per_seq

    def chat_tokens(self, prompt: str) -> list[int]:
        be = self.backend
        return be.tokenize(be.chat_prompt([{"role": "user", "content": prompt}]), special=True)

    def run(self, rows: list[dict[str, str]], max_tokens: int) -> Iterator[tuple[dict, list[int]]]:
        """Yield (row, output tokens without the end-of-turn token), a batch at a time."""
        import torch

        room = self.n_ctx_per_seq - max_tokens
        prompts = [self.chat_tokens(r["prompt"])[-room:] for r in rows]
        order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))  # little padding
        eos = sorted(self.backend.eos_token_ids)
        model = self.backend.hf_model
        for start in range(0, len(order), self.batch):
            idx = order[start : start + self.batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, i in enumerate(idx):  # left-padded: every row's answer starts at `width`
                ids[j, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[j, width - len(prompts[i]) :] = 1
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                )
            for j, i in enumerate(idx):
                toks = out[j, width:].tolist()
                end = next((n for n, t in enumerate(toks) if t in eos), len(toks))
                yield rows[i], toks[:end]

    def close(self) -> None:
        self.backend.close()


def chat_template_of(model_path: Path) -> ChatTemplate:
    """The chat template a runtime with no chat_template setting uses for this model."""
    from memspec.drafts.gguf_header import open_header, scalar

    reader = open_header(model_path)
    keys = ("general.architecture", "tokenizer.chat_template", "tokenizer.ggml.pre")
    metadata = {k: str(v) for k in keys if (v := scalar(reader, k)) is not None}
    return resolve_chat_template(None, metadata, model_path.name)


def _model_tag(model_path: Path) -> str:
    """The model and the template its answers were prompted with (a model with its own
    template keeps the tag it had before templates were resolved)."""
    st = model_path.stat()
    key = f"{model_path.name}:{st.st_size}"
    source = chat_template_of(model_path).source
    if source != "gguf":
        key += f":{source}"
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def generated_corpus_path(model_path: Path, teacher: str = "llama_cpp") -> Path:
    # torch's answers are bfloat16 text (TorchGreedy), not llama.cpp's: cached apart.
    suffix = "" if teacher == "llama_cpp" else f"-{teacher}-bf16"
    return cache_dir() / "corpus" / f"gen-{model_path.stem}-{_model_tag(model_path)}{suffix}.jsonl"


def _covers(rec: dict, max_tokens: int) -> bool:
    # Greedy output for N tokens is a prefix of the output for more; one that ended on EOS
    # is complete at any length.
    return rec["max_tokens"] >= max_tokens or len(rec["tokens"]) < rec["max_tokens"]


def read_cache(path: Path, max_tokens: int) -> dict[str, dict]:
    """Cached generations that cover max_tokens, truncated to it, by prompt."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    with path.open() as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupted run: regenerate it
                continue
            if _covers(r, max_tokens):
                done[r["prompt"]] = {**r, "tokens": r["tokens"][:max_tokens]}
    return done


def generate_outputs(
    model_path: Path,
    rows: list[dict[str, str]],
    max_tokens: int,
    n_threads: int = 1,
    batch: int = 48,
    progress: bool = True,
    teacher: str = "llama_cpp",
) -> list[dict]:
    """The target's greedy answer to each seed prompt, from the cache or generated (resumable)
    by llama.cpp (`teacher` "llama_cpp") or in bfloat16 through transformers ("torch")."""
    path = generated_corpus_path(model_path, teacher)
    done = read_cache(path, max_tokens)
    todo = [r for r in rows if r["prompt"] not in done]
    if todo:
        path.parent.mkdir(parents=True, exist_ok=True)
        gen: BatchedGreedy | TorchGreedy
        if teacher == "torch":
            gen = TorchGreedy(model_path, n_ctx_per_seq=max_tokens + 256, n_threads=n_threads)
        else:
            gen = BatchedGreedy(
                model_path, batch=batch, n_ctx_per_seq=max_tokens + 256, n_threads=n_threads
            )
        try:
            with (
                path.open("a") as f,
                tqdm(
                    total=len(todo),
                    desc="corpus: target outputs",
                    unit="prompt",
                    disable=not progress,
                ) as bar,
            ):
                for row, out in gen.run(todo, max_tokens):
                    rec = {
                        "domain": row["domain"],
                        "prompt": row["prompt"],
                        "max_tokens": max_tokens,
                        "tokens": out,
                    }
                    f.write(json.dumps(rec) + "\n")
                    f.flush()  # each finished generation survives an interruption
                    done[row["prompt"]] = rec
                    bar.update(1)
        finally:
            gen.close()
    return [done[r["prompt"]] for r in rows]


def stdlib_files(seed: int = 0) -> list[Path]:
    """Python standard library sources (no tests, no vendored packages), in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "ensurepip",
        "turtledemo",
        "__pycache__",
        "tkinter",
        "pydoc_data",
    }
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if not skip & set(p.relative_to(root).parts) and p.stat().st_size < 200_000
    ]
    random.Random(seed).shuffle(files)
    return files


def pydoc_topics() -> list[str]:
    """Prose help on Python (pydoc_data.topics), shipped with the interpreter."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k] for k in sorted(topics)]


def package_texts(max_chars: int, seed: int = 0, include_docs: bool = True) -> Iterator[str]:
    """Up to max_chars of stdlib source (then pydoc prose), file by file."""
    used = 0
    sources: list[str] = []
    for p in stdlib_files(seed):
        try:
            sources.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if sum(map(len, sources)) > max_chars:
            break
    if include_docs:
        sources += pydoc_topics()
    for text in sources:
        if used >= max_chars:
            return
        text = text[: max_chars - used]
        used += len(text)
        yield text


def default_threads() -> int:
    # Long corpus generation must leave the other core to whoever shares this machine.
    return build_threads()


if __name__ == "__main__":  # quick manual run: python -m memspec.recipes.corpus N MAX_TOKENS
    from memspec.paths import models_dir

    n, mt = int(sys.argv[1]), int(sys.argv[2])
    out = generate_outputs(
        models_dir() / "smollm2-135m-f32.gguf",
        select_seeds(None, n, 0),
        mt,
        n_threads=default_threads(),
    )
    print(sum(len(r["tokens"]) for r in out), "tokens")


class Tokenizer:
    """The target's tokenizer alone (vocab-only load: no weights)."""

    def __init__(self, model_path: Path):
        import llama_cpp

        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            self.llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def close(self) -> None:
        self.llm.close()
