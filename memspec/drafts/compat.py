"""Does a draft speak the target's tokenizer? A draft proposes token *ids*; the target verifies
ids. Under another tokenizer the same id is other text (or out of range, and llama_decode
fails), so such a draft is never offered for that target.

The rule is llama.cpp's (`common_speculative_are_compatible`, common/speculative.cpp): the
same vocabulary type, the same BOS/EOS ids (and whether they are added), sizes within 128
tokens, and the same token texts over the ids both have (from id 5 on). Identical hashes of
the token arrays are the fast path; only when they differ are the texts read and compared.

Which tokenizer a draft speaks depends on its kind, decided in one table (`_TOKENIZER_OF`):
a model draft's is in its GGUF; a datastore records the fingerprint of the tokenizer it was
built with; prompt lookup copies the target's own tokens and speaks any.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from memspec.drafts.gguf_header import read_token_texts, read_tokenizer_fields
from memspec.drafts.manifest import DraftManifest
from memspec.errors import DraftIncompatible, ModelLoadError

SIZE_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_ID = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID: ids below are not compared


@dataclass(frozen=True)
class TokenizerFingerprint:
    """A tokenizer, as far as speculative decoding cares, small enough to store anywhere."""

    model: str | None  # tokenizer.ggml.model: "gpt2" (BPE), "llama" (SentencePiece), ...
    n_vocab: int
    tokens_sha256: str  # of the raw bytes of the token-text array
    token_types_sha256: str  # of the raw bytes of the token-type array
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None = None  # None: the GGUF does not say
    add_eos: bool | None = None
    # The GGUF it was read from, for the token texts when hashes differ (not part of identity).
    source: str | None = field(default=None, compare=False)

    @property
    def digest(self) -> str:
        """Eight hex digits that tell tokenizers apart (for display and logs)."""
        blob = json.dumps(self._identity(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:8]

    def describe(self) -> str:
        name = self.model or "unnamed"
        return f"a {name} tokenizer of {self.n_vocab} tokens (fingerprint {self.digest})"

    def _identity(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    def to_dict(self) -> dict[str, Any]:
        return {**self._identity(), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerFingerprint:
        """ValueError if `d` is not a fingerprint (a damaged or foreign artifact)."""
        try:
            fp = cls(
                model=None if d["model"] is None else str(d["model"]),
                n_vocab=int(d["n_vocab"]),
                tokens_sha256=str(d["tokens_sha256"]),
                token_types_sha256=str(d["token_types_sha256"]),
                bos_id=None if d["bos_id"] is None else int(d["bos_id"]),
                eos_id=None if d["eos_id"] is None else int(d["eos_id"]),
                add_bos=None if d.get("add_bos") is None else bool(d["add_bos"]),
                add_eos=None if d.get("add_eos") is None else bool(d["add_eos"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a tokenizer fingerprint: {e!r}") from e
        if "digest" in d and d["digest"] != fp.digest:
            raise ValueError("tokenizer fingerprint does not match its digest")
        return fp


def fingerprint_of(path: str | Path) -> TokenizerFingerprint | None:
    """The tokenizer in a GGUF's header (None: it has none). ModelLoadError if unreadable."""
    f = read_tokenizer_fields(path)
    if f is None:
        return None
    return TokenizerFingerprint(
        model=f.model,
        n_vocab=f.n_tokens,
        tokens_sha256=f.tokens_sha256,
        token_types_sha256=f.token_types_sha256,
        bos_id=f.bos_id,
        eos_id=f.eos_id,
        add_bos=f.add_bos,
        add_eos=f.add_eos,
        source=str(path),
    )


def _text_mismatch(target: TokenizerFingerprint, draft: TokenizerFingerprint) -> str | None:
    """Where the token texts differ over the ids both have (from FIRST_CHECKED_ID on)."""
    if target.source is None or draft.source is None:
        return "token texts differ (only their hashes are known: no GGUF to compare them)"
    t_texts, d_texts = read_token_texts(target.source), read_token_texts(draft.source)
    for i in range(FIRST_CHECKED_ID, min(len(t_texts), len(d_texts))):
        if t_texts[i] != d_texts[i]:
            return f"token {i} is {d_texts[i]!r} here, {t_texts[i]!r} in the target"
    return None


def _mismatch(target: TokenizerFingerprint, draft: TokenizerFingerprint) -> str | None:
    """What breaks llama.cpp's rule: "" for another vocabulary type, a detail, or None."""
    if target == draft:
        return None  # the fast path: every hash equal
    if target.model != draft.model:
        return ""  # the two descriptions say it
    for flag in ("add_bos", "add_eos"):
        t, d = getattr(target, flag), getattr(draft, flag)
        if t is not None and d is not None and t != d:
            return f"{flag} {d} here, {t} in the target"
    if (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        return (
            f"BOS/EOS ids {draft.bos_id}/{draft.eos_id} here, "
            f"{target.bos_id}/{target.eos_id} in the target"
        )
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > SIZE_SLACK:
        return f"vocabulary sizes differ by {diff} tokens, more than {SIZE_SLACK}"
    if target.tokens_sha256 == draft.tokens_sha256:
        return None  # same texts; token types are not part of the rule
    return _text_mismatch(target, draft)


def incompatibility(target: TokenizerFingerprint, draft: TokenizerFingerprint) -> str | None:
    """One line saying why a draft with tokenizer `draft` cannot serve `target`, or None."""
    detail = _mismatch(target, draft)
    if detail is None:
        return None
    reason = f"built for {draft.describe()}; the target has {target.describe()}"
    return f"{reason}: {detail}" if detail else reason


class _Unverifiable(Exception):
    """What a draft speaks cannot be told (its reason says what to do)."""


def _model_tokenizer(m: DraftManifest, path: Path) -> TokenizerFingerprint:
    fp = fingerprint_of(path)
    if fp is None:
        raise _Unverifiable(f"its GGUF {path.name} carries no tokenizer")
    return fp


def _datastore_tokenizer(m: DraftManifest, path: Path) -> TokenizerFingerprint:
    from memspec.drafts.datastore import read_meta  # it imports this module to write one

    d = read_meta(path).get("tokenizer")
    rebuild = f"rebuild it with `memspec drafts build --only {m.id}`"
    if not d:
        raise _Unverifiable(
            "it was built without a tokenizer fingerprint (an older datastore format), so "
            f"which token ids it holds is unknown: {rebuild}"
        )
    try:
        return TokenizerFingerprint.from_dict(d)
    except ValueError as e:
        raise _Unverifiable(f"its tokenizer fingerprint is damaged ({e}): {rebuild}") from e


def _head_tokenizer(m: DraftManifest, path: Path) -> TokenizerFingerprint:
    from memspec.drafts.head import read_meta

    d = read_meta(path).get("tokenizer")
    try:
        return TokenizerFingerprint.from_dict(d)
    except (TypeError, ValueError) as e:
        raise _Unverifiable(
            f"its tokenizer fingerprint is missing or damaged ({e}): rebuild it with "
            f"`memspec drafts build --only {m.id}`"
        ) from e


# Per kind: where a draft's tokenizer comes from (None: the kind has none and speaks any).
_TOKENIZER_OF: dict[str, Callable[[DraftManifest, Path], TokenizerFingerprint] | None] = {
    "model": _model_tokenizer,
    "datastore": _datastore_tokenizer,
    "head": _head_tokenizer,
    "prompt_lookup": None,
}


def check_draft(
    target: TokenizerFingerprint | None, m: DraftManifest, models_dir: Path
) -> str | None:
    """Why draft `m` cannot serve a target with tokenizer `target`, or None: compatible, a
    kind without a tokenizer, a target without one, or a file not built or unreadable yet
    (that is a load failure, reported when it is loaded, not an incompatibility)."""
    if m.kind not in _TOKENIZER_OF:
        return f"no tokenizer rule for drafts of kind {m.kind!r}"
    rule = _TOKENIZER_OF[m.kind]
    if rule is None or target is None or not m.file:
        return None
    path = m.model_path(models_dir)
    if not path.is_file():
        return None
    try:
        return incompatibility(target, rule(m, path))
    except ModelLoadError:
        return None
    except _Unverifiable as e:
        return str(e)


def incompatible_error(draft_id: str, reason: str) -> DraftIncompatible:
    """The error a request naming an incompatible draft gets."""
    message = f"draft {draft_id!r} cannot serve this target: {reason}"
    return DraftIncompatible(message, param="draft")


def require_compatible(
    target: TokenizerFingerprint | None, m: DraftManifest, models_dir: Path
) -> None:
    """DraftIncompatible if `m` cannot serve the target (see check_draft)."""
    reason = check_draft(target, m, models_dir)
    if reason is not None:
        raise incompatible_error(m.id, reason)
