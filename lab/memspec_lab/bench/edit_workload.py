"""The edit workload of `memspec bench engine`: whole-file edits, whose answers copy the prompt.

A code assistant sends a file and asks for it back changed ("rename x to y", "add type hints",
"fix this bug"), so most of the answer repeats the prompt: the case prompt lookup, the
datastore's context matches and their match-length rule (memspec.drafts.prompt_lookup) are for.
The files are real Python sources of about 1k-8k tokens from packages that memspec depends on
(pyproject.toml), so every checkout's venv has them: each prompt is one row of
`data/edit_files.jsonl` (package, path in it, kind, instruction; a fix-bug row injects its bug
with a find/replace that must match once, the others name what the file must contain). The
report records each file's package version, path and SHA-256, since a package other than the
one pinned here may hold another version (a row whose file or anchor is missing is skipped,
with the reason). The prompt is chat-formatted: the file in a ```python block, then the
instruction, then "return the whole file".

The split is fixed by the rows: `edit` is the held-out part, what results are reported on, and
`edit-tuning` the part a tuning may read. Held out (no tuning, prior, predictor or default
may be fitted to them): llama_cpp/server/cli.py, llama_cpp/server/errors.py,
tomli_w/_writer.py, llama_cpp/server/model.py, llama_cpp/server/app.py, psutil/_common.py.
Nothing here reads site-packages source to build a draft (the datastore corpus is the
standard library's), so only `edit-tuning` may ever be added to one.

The context is sized to the prompts: prompt + max_tokens, at most the target's trained context
(SmolLM2: 8,192); `max_file_tokens` (default: what that leaves) skips the files longer than
that (counted with their instruction, before the chat template). `max_tokens = "file"` gives
each answer room for its whole file (the file's tokens + WHOLE_FILE_MARGIN), so the answer
can repeat all of it and decoding, not the prompt, takes most of the time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from memspec_lab.bench.workloads import BenchPrompt

EDIT_WORKLOADS = {"edit": "heldout", "edit-tuning": "tuning"}  # workload -> split
EDIT_KINDS = ("fix-bug", "rename", "type-hints")
FILES = Path(__file__).resolve().parent / "data" / "edit_files.jsonl"
# Tokens a chat template and the request around the file add (Qwen's default system prompt,
# the instruction): a margin when the context is sized before the runtime exists.
TEMPLATE_TOKENS = 96
KV_PAD = 256  # llama.cpp pads the KV cache to this many cells
# An answer that repeats the file also opens and closes its ```python block and may say a line.
WHOLE_FILE_MARGIN = 64


@dataclass(frozen=True)
class EditPrompt(BenchPrompt):
    heldout: bool = True
    answer_tokens: int | None = None  # this prompt's max_tokens (None: the run's)
    # package, version, path, sha256 (of the file as installed), chars; and tokens: the
    # user message's with the target's tokenizer (the file and its instruction)
    source: dict = field(default_factory=dict)


def edit_rows() -> list[dict]:
    return [json.loads(line) for line in FILES.read_text().splitlines() if line.strip()]


def load_edit_workload(
    name: str, per_category: int, categories: list[str] | None = None
) -> tuple[list[EditPrompt], list[dict]]:
    """Up to `per_category` prompts of each edit kind of workload `name` ("edit": the held-out
    part, "edit-tuning"), in the rows' order; and the rows skipped, each with its reason."""
    split = EDIT_WORKLOADS[name]
    prompts: list[EditPrompt] = []
    skipped: list[dict] = []
    counts: dict[str, int] = {}
    for row in edit_rows():
        kind = row["kind"]
        if row["split"] != split or (categories and kind not in categories):
            continue
        if counts.get(kind, 0) >= per_category:
            continue
        try:
            prompts.append(edit_prompt(row))
        except LookupError as e:
            skipped.append({"id": row["id"], "path": row["path"], "reason": str(e)})
            continue
        counts[kind] = counts.get(kind, 0) + 1
    return prompts, skipped


def edit_prompt(row: dict) -> EditPrompt:
    """One row's prompt: the installed file (its bug injected), the instruction. LookupError:
    the package, the file or the row's anchor is not there."""
    try:
        dist = md.distribution(row["dist"])
    except md.PackageNotFoundError as e:
        raise LookupError(f"package {row['dist']} not installed") from e
    path = Path(str(dist.locate_file(row["path"])))
    if not path.is_file():
        raise LookupError(f"{row['path']} not in {row['dist']} {dist.version}")
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    for anchor in row.get("requires", []):
        if anchor not in text:
            raise LookupError(f"{row['dist']} {dist.version}: {anchor!r} not in {row['path']}")
    inject = row.get("inject")
    if inject is not None:
        if text.count(inject["find"]) != 1:
            raise LookupError(
                f"{row['dist']} {dist.version}: the bug's anchor is not once in {row['path']}"
            )
        text = text.replace(inject["find"], inject["replace"])
    if not text.endswith("\n"):
        text += "\n"
    request = (
        f"Here is the file `{row['path']}`:\n\n```python\n{text}```\n\n{row['instruction']} "
        "Return the whole file with the change, in one ```python block."
    )
    source = {
        "package": row["dist"],
        "version": dist.version,
        "path": row["path"],
        "sha256": hashlib.sha256(raw).hexdigest(),
        "chars": len(text),
    }
    heldout = row["split"] == "heldout"
    return EditPrompt(row["id"], row["kind"], request, True, heldout=heldout, source=source)


def with_project_context(
    prompts: list[EditPrompt], target: Path, context_tokens: int
) -> list[EditPrompt]:
    """Each prompt preceded by the other held-out files until its message is about
    `context_tokens` tokens (counted with the target's tokenizer); the files used are recorded
    in its source. A prompt already that long is kept as it is."""
    files: dict[str, str] = {}
    for row in edit_rows():
        if row["split"] == "heldout" and row["path"] not in files:
            dist = md.distribution(row["dist"])
            files[row["path"]] = Path(str(dist.locate_file(row["path"]))).read_text()
    paths = list(files)
    sizes = dict(zip(paths, count_tokens(target, [files[f] for f in paths]), strict=True))
    own = count_tokens(target, [p.text for p in prompts])
    padded: list[EditPrompt] = []
    for p, n in zip(prompts, own, strict=True):
        room = context_tokens - n
        parts: list[str] = []
        used: list[str] = []
        for path in paths:
            if room <= 0:
                break
            if path == p.source["path"]:
                continue
            text = files[path]
            if sizes[path] > room:  # cut at a line, at the file's own tokens per character
                text = text[: int(len(text) * room / sizes[path])].rsplit("\n", 1)[0] + "\n"
            parts.append(f"`{path}`:\n```python\n{text}```\n\n")
            used.append(path)
            room -= min(sizes[path], room)
        if not parts:
            padded.append(p)
            continue
        text = "Other files of the project, for reference:\n\n" + "".join(parts) + p.text
        source = {**p.source, "file_tokens": n, "context_files": used}
        padded.append(replace(p, text=text, source=source))
    return padded


def count_tokens(target: Path, texts: list[str]) -> list[int]:
    """Tokens of each text with the target's tokenizer (a vocab-only load: no weights)."""
    import llama_cpp

    with contextlib.redirect_stderr(io.StringIO()):
        llm = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    try:
        return [len(llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)) for t in texts]
    finally:
        llm.close()


def fit_context(
    prompts: list[EditPrompt],
    target: Path,
    max_tokens: int | str,
    n_ctx: int,
    max_file_tokens: int | None = None,
) -> tuple[list[EditPrompt], list[dict], int]:
    """The prompts whose file and answer fit the target's trained context (and
    `max_file_tokens`), the ones skipped with the reason, and the context to run them at:
    `n_ctx` or, if more is needed, the longest prompt + its answer (padded, at most trained).
    `max_tokens = "file"`: each answer as long as its file (+ WHOLE_FILE_MARGIN)."""
    from memspec.memory.plan import trained_context

    trained = trained_context(target)
    whole_file = max_tokens == "file"
    if not whole_file and not isinstance(max_tokens, int):
        raise ValueError(f"max_tokens {max_tokens!r}: a number of tokens or 'file'")
    limit = max_file_tokens or (
        (trained - TEMPLATE_TOKENS - WHOLE_FILE_MARGIN) // 2
        if whole_file
        else trained - int(max_tokens) - TEMPLATE_TOKENS
    )
    counts = count_tokens(target, [p.text for p in prompts])
    kept: list[EditPrompt] = []
    skipped: list[dict] = []
    need = 0
    for p, n in zip(prompts, counts, strict=True):
        # The file's own tokens: a long-context prompt also holds the project's other files.
        file_n = p.source.get("file_tokens", n)
        answer = file_n + WHOLE_FILE_MARGIN if whole_file else int(max_tokens)
        fits = file_n <= limit and n + TEMPLATE_TOKENS + answer <= trained
        if not fits:
            why = f"{n} tokens: over --max-file-tokens {limit} or the trained context {trained}"
            skipped.append({"id": p.id, "path": p.source["path"], "reason": why})
            continue
        p.source["tokens"] = n  # a frozen dataclass; its dict is the report's
        kept.append(replace(p, answer_tokens=answer) if whole_file else p)
        need = max(need, n + TEMPLATE_TOKENS + answer)
    padded = -(-need // KV_PAD) * KV_PAD
    return kept, skipped, max(n_ctx, min(padded, trained))
