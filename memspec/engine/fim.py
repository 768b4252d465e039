"""Fill-in-the-middle prompts, as llama-server's /infill builds them.

A target can fill in the middle when its vocabulary has the FIM control tokens: the GGUF names
them (`tokenizer.ggml.fim_pre_token_id` ...), or, as llama.cpp also does, the vocabulary holds
one of their usual spellings as a single special token. The prompt is PSM order:

    [BOS] [repo context] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID> [start of the middle]

where the repo context (llama-server's `input_extra`) is <FIM_REP> "myproject\\n", then per
chunk <FIM_SEP> filename "\\n" text, then <FIM_SEP> "filename\\n". The model writes the middle
and ends it with an end-of-generation token (FimTokens.end: <|endoftext|>, a file separator...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memspec.backends.base import Backend
from memspec.errors import InvalidRequest

# GGUF keys (llama.cpp's current names, then its older ones) and the usual token spellings.
_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}
_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<｜fim▁begin｜>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<｜fim▁hole｜>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<｜fim▁end｜>"),
    "rep": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>"),
}
# What ends a middle besides EOS (llama.cpp counts them end-of-generation): a FIM model may
# close the middle with <|endoftext|> and go on to another file with these.
_END_TEXTS = ("<|endoftext|>", "<|fim_pad|>", "<fim_pad>", "<EOT>", "<|eot_id|>")


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None
    end: frozenset[int] = frozenset()  # tokens that end the middle (with the target's EOS)


@dataclass
class FimRequest:
    """What to fill: the text before and after the hole, optionally the start of the middle
    and other files of the project (filename, text)."""

    prefix: str
    suffix: str
    middle: str = ""
    extra: list[tuple[str, str]] = field(default_factory=list)
    param: str = "suffix"  # the request field a refusal names


def _special_token(backend: Backend, text: str) -> int | None:
    """The id of `text` if the vocabulary holds it as one special token."""
    ids = backend.tokenize(text, add_bos=False, special=True)
    if len(ids) != 1:
        return None
    # A special token: parsed as text it is several tokens.
    return ids[0] if len(backend.tokenize(text, add_bos=False, special=False)) > 1 else None


def find_fim_tokens(backend: Backend) -> FimTokens | None:
    """The target's FIM tokens, or None when it has no prefix/suffix/middle tokens."""
    found: dict[str, int | None] = {}
    for role, keys in _KEYS.items():
        tok = None
        for key in keys:
            value = backend.metadata.get(key)
            if value is not None and str(value).lstrip("-").isdigit() and int(value) >= 0:
                tok = int(value)
                break
        for spelling in _TEXTS[role] if tok is None else ():
            if (tok := _special_token(backend, spelling)) is not None:
                break
        found[role] = tok
    pre, suf, mid = found["pre"], found["suf"], found["mid"]
    if pre is None or suf is None or mid is None:
        return None
    end = {found["rep"], found["sep"], *(_special_token(backend, s) for s in _END_TEXTS)}
    return FimTokens(pre, suf, mid, found["rep"], found["sep"], frozenset(end - {None}))


def fim_prompt(backend: Backend, fim: FimRequest, tokens: FimTokens | None) -> list[int]:
    """The prompt tokens of `fim` (llama-server's format_infill, PSM); a 400 naming
    fim.param when the target has no FIM tokens."""
    if tokens is None:
        raise InvalidRequest(
            f"{backend.path.name} has no fill-in-the-middle tokens "
            "(tokenizer.ggml.fim_pre/suf/mid_token_id): serve a FIM-capable target "
            "(e.g. Qwen2.5-Coder) to use it",
            param=fim.param,
        )

    def text(s: str) -> list[int]:
        return backend.tokenize(s, add_bos=False) if s else []

    out = backend.tokenize("", add_bos=True)  # [BOS] when the tokenizer adds one
    if fim.extra:
        if tokens.rep is not None:
            out += [tokens.rep, *text("myproject\n")]
        for filename, chunk in fim.extra:
            if tokens.sep is not None:
                out += [tokens.sep, *text((filename or "tmp") + "\n")]
            else:
                out += text("\n\n--- snippet ---\n\n")
            out += text(chunk)
        if tokens.sep is not None:
            out += [tokens.sep, *text("filename\n")]
    out += [tokens.pre, *text(fim.prefix), tokens.suf, *text(fim.suffix), tokens.mid]
    return out + text(fim.middle)
