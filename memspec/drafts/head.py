"""Draft kind "head" (EAGLE-style): a small network that drafts from the target's own features.

Given the target's feature f_t (its final hidden state at the last verified position t, the
input of its output layer) and the embedding of the next token x_{t+1} (the one the target
just chose), the head predicts f_{t+1}; the target's own output rows turn that into the next
token, whose embedding feeds the next step on the head's predicted feature, k times.

- One block: a projection of [f, e(x)] back to the hidden size and a gated MLP with a residual
  (no attention: the target's feature already summarises the context, and a head without a
  KV cache has no state to roll back; every round starts afresh from a verified feature).
- Proposals come from a frequency-ranked sub-vocabulary of N tokens: the head holds only those
  N rows of the target's output matrix (and of its embeddings), not 49k or 262k of them. Its
  distribution is zero outside them, which keeps rejection sampling exact: the engine's
  min(1, p/q) test and residual only need q of the proposed token and q ≥ 0 elsewhere.
- A token outside the sub-vocabulary (the target's choice can be any token) enters as one
  learned embedding.

The artifact is a safetensors file (float16; the head runs in float16 on CPU and CUDA): the
block's weights, the sub-vocabulary ids and rows, and
metadata naming the target (its hidden size, vocabulary and tokenizer fingerprint) it was
trained on. memspec.recipes.head_build trains one (recipe "head").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from memspec.backends.base import Backend
from memspec.drafts.model import choose_token
from memspec.engine.types import Draft, Proposal, SamplingParams
from memspec.errors import ModelLoadError

FORMAT = "memspec-head"
FORMAT_VERSION = 1
# The confidence below which a step is the round's last (as ModelDraft: length only).
MIN_CONFIDENCE = 0.3


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ModelLoadError(
            "head drafts run in torch: install the torch extra (pip install 'memspec[torch]')",
            param="draft",
        ) from e
    return torch


def head_net(n_embd: int, hidden: int, out_rows: Any, in_rows: Any | None = None) -> Any:
    """The head's torch module. out_rows (N, n_embd): the target's output-matrix rows of the
    sub-vocabulary; in_rows: their input embeddings (None: tied to out_rows)."""
    torch = _torch()
    nn = torch.nn

    class HeadNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.feat_norm = nn.RMSNorm(n_embd, eps=1e-6)
            self.embed_norm = nn.RMSNorm(n_embd, eps=1e-6)
            self.fc = nn.Linear(2 * n_embd, n_embd, bias=False)
            self.mlp_norm = nn.RMSNorm(n_embd, eps=1e-6)
            self.gate = nn.Linear(n_embd, hidden, bias=False)
            self.up = nn.Linear(n_embd, hidden, bias=False)
            self.down = nn.Linear(hidden, n_embd, bias=False)
            self.unk = nn.Parameter(torch.zeros(n_embd))  # any token outside the sub-vocabulary
            # The target's rows: frozen, part of the artifact (kept in the dtype given).
            self.register_buffer("out_rows", out_rows.contiguous())
            self.tied = in_rows is None
            if in_rows is not None:
                self.register_buffer("in_rows", in_rows.contiguous())

        def embed(self, sub_index: Any) -> Any:
            """Input embeddings of sub-vocabulary indices; index N is the unknown token."""
            rows = self.out_rows if self.tied else self.in_rows
            known = sub_index < len(rows)
            e = rows[torch.where(known, sub_index, 0)]  # indexing, not a copy of the table
            return torch.where(known[..., None], e, self.unk)

        def forward(self, feature: Any, sub_index: Any) -> Any:
            """The predicted next feature from this feature and the next token."""
            x = self.fc(
                torch.cat([self.feat_norm(feature), self.embed_norm(self.embed(sub_index))], -1)
            )
            h = self.mlp_norm(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

        def logits(self, feature: Any) -> Any:
            """Logits over the sub-vocabulary: the target's output layer, restricted."""
            return feature @ self.out_rows.T

    return HeadNet()


def save_head(net: Any, sub_ids: np.ndarray, path: Path, meta: dict[str, Any]) -> None:
    """Write the artifact: every tensor of the module plus the sub-vocabulary ids."""
    from safetensors.torch import save_file

    torch = _torch()
    # float16: a drafted token streams every weight once, and on a CPU half the bytes is
    # about a third of the time (8192 x 576 rows: 0.8 ms against 2.8 ms in float32).
    tensors = {k: v.detach().cpu().half().contiguous() for k, v in net.state_dict().items()}
    tensors["sub_ids"] = torch.from_numpy(np.asarray(sub_ids, dtype=np.int64))
    header = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    header |= {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    save_file(tensors, str(path), metadata=header)


MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


def check_safetensors(path: Path) -> None:
    """ModelLoadError unless the header fits the file: its declared length, and every
    tensor's dtype, shape and byte range within the data (checked before any reader maps or
    allocates what the header claims)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except FileNotFoundError as e:
        raise ModelLoadError(f"draft file not found: {path}", param="draft") from e
    except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError included
        raise ModelLoadError(
            f"{path.name} is damaged (not a readable safetensors file): {e}", param="draft"
        ) from e
    data = size - 8 - n
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path.name} is damaged: its header is not an object", param="draft")
    for name, t in header.items():
        if name == "__metadata__":
            ok = isinstance(t, dict) and all(isinstance(v, str) for v in t.values())
        else:
            ok = _tensor_fits(t, data)
        if not ok:
            raise ModelLoadError(
                f"{path.name} is damaged: tensor {str(name)[:80]!r} does not fit the file's data",
                param="draft",
            )


def _tensor_fits(t: Any, data: int) -> bool:
    if not isinstance(t, dict) or t.get("dtype") not in _DTYPE_BYTES:
        return False
    shape, offsets = t.get("shape"), t.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return False
    if len(shape) > 8 or not all(type(d) is int and 0 <= d <= data for d in shape):
        return False
    begin, end = offsets
    if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data):
        return False
    return end - begin == math.prod(shape) * _DTYPE_BYTES[t["dtype"]]


def read_meta(path: Path) -> dict[str, Any]:
    """The artifact's metadata (JSON values decoded); ModelLoadError if it is no head file."""
    check_safetensors(path)
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ModelLoadError("head drafts need safetensors (the torch extra)") from e
    try:
        with safe_open(str(path), "np") as f:
            raw = f.metadata() or {}
    except FileNotFoundError as e:
        raise ModelLoadError(f"draft file not found: {path}", param="draft") from e
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ModelLoadError(f"{path.name} is not a readable head file: {e}", param="draft") from e
    if raw.get("format") != FORMAT:
        raise ModelLoadError(f"{path.name} is not a memspec head file", param="draft")
    if raw.get("format_version") != str(FORMAT_VERSION):
        raise ModelLoadError(
            f"{path.name} is head format {raw.get('format_version')}, this memspec reads "
            f"{FORMAT_VERSION}: rebuild it",
            param="draft",
        )
    meta: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            meta[k] = json.loads(v)
        except ValueError:
            meta[k] = v
    return meta


def load_head_net(path: Path, device: str = "cpu") -> tuple[Any, np.ndarray, dict[str, Any]]:
    """(module, sub-vocabulary ids, metadata) from an artifact; ModelLoadError if damaged."""
    meta = read_meta(path)
    from safetensors.torch import load_file

    torch = _torch()
    try:
        # Copied out of the file's pages into process memory once; the module then takes
        # these very tensors (built on the meta device, assigned): nothing is held twice.
        tensors = {k: v.clone() for k, v in load_file(str(path), device="cpu").items()}
        sub_ids = tensors.pop("sub_ids").numpy()
        n_embd, n_vocab = int(meta["n_embd"]), int(meta["n_vocab"])
        rows = [tensors["out_rows"]] + ([tensors["in_rows"]] if "in_rows" in tensors else [])
        if any(tuple(r.shape) != (len(sub_ids), n_embd) for r in rows):
            raise ValueError(
                f"rows of shape {[tuple(r.shape) for r in rows]}, expected "
                f"({len(sub_ids)}, {n_embd})"
            )
        # Each proposed token's probability is read at its id: ids must be distinct and real.
        if len(sub_ids) == 0 or len(np.unique(sub_ids)) != len(sub_ids):
            raise ValueError("the sub-vocabulary is empty or repeats a token")
        if sub_ids.min() < 0 or sub_ids.max() >= n_vocab:
            raise ValueError(f"sub-vocabulary ids outside the vocabulary of {n_vocab}")
        with torch.device("meta"):
            net = head_net(n_embd, int(meta["hidden"]), rows[0], rows[1] if len(rows) > 1 else None)
        net.load_state_dict(tensors, strict=True, assign=True)
    except Exception as e:  # truncated data, a missing tensor, shapes that do not fit
        raise ModelLoadError(f"{path.name}: damaged head file: {e}", param="draft") from e
    return net.to(device).eval(), sub_ids, meta


def head_bytes(path: Path) -> int:
    """What a loaded head holds: the artifact's tensors and an int64 index per target token."""
    n_vocab = read_meta(path).get("n_vocab")
    if not isinstance(n_vocab, int):
        raise ModelLoadError(f"{path.name}: damaged head file: no n_vocab", param="draft")
    return path.stat().st_size + 8 * n_vocab


class HeadDraft(Draft):
    """Drafts k tokens from the target's feature at the last verified token (see module doc).

    It reads the target's features through `target.features_at`, so the target must be loaded
    with BackendOptions.features; the runtime does that when its pool holds a head."""

    kind = "head"

    def __init__(self, id: str, path: Path, target: Backend, device: str = "cpu"):
        if not target.options.features:
            raise ModelLoadError(
                f"draft {id} reads the target's features, but the target was loaded without "
                "them (a head built after the daemon started: restart it)",
                param="draft",
            )
        self.torch = _torch()
        meta = read_meta(path)  # checked against the target before any tensor is read
        for what, have in (("n_embd", target.n_embd), ("n_vocab", target.n_vocab)):
            if int(meta.get(what, -1)) != have:
                raise ModelLoadError(
                    f"draft {id}: {path.name} was trained for a target with {what} "
                    f"{meta.get(what)}; this target has {have}",
                    param="draft",
                )
        self.net, self.sub_ids, meta = load_head_net(path, device)
        self.id, self.path, self.target, self.device = id, path, target, device
        self.meta = meta
        # token id -> sub-vocabulary index; N (the unknown embedding) for every other token.
        n = len(self.sub_ids)
        self.sub_index = np.full(target.n_vocab, n, dtype=np.int64)
        self.sub_index[self.sub_ids] = np.arange(n)
        self.min_confidence = MIN_CONFIDENCE

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        # The feature at the token before the pending one: the last row the target verified.
        feature = self.target.features_at(len(context) - 2) if len(context) >= 2 else None
        if k <= 0 or feature is None:
            return Proposal(key=self.id)
        torch = self.torch
        tokens: list[int] = []
        probs: list[np.ndarray] | None = None if params.greedy else []
        with torch.inference_mode():
            f = torch.tensor(feature, dtype=torch.float16, device=self.device)
            index = int(self.sub_index[context[-1]])
            for i in range(k):
                f = self.net(f, torch.tensor(index, device=self.device))
                logits = self.net.logits(f).float().cpu().numpy()
                index, q_sub, confidence = choose_token(logits, params, rng)
                if probs is not None:
                    q = np.zeros(self.target.n_vocab)  # zero outside the sub-vocabulary
                    q[self.sub_ids] = q_sub
                    probs.append(q)
                tokens.append(int(self.sub_ids[index]))
                if i > 0 and confidence < self.min_confidence:
                    break  # keep the unsure token (one try is cheap), stop paying for more
        return Proposal(tokens=tokens, probs=probs, key=self.id)

    def token_step(self) -> Callable[[], None]:
        """One drafted token's work on a stand-in feature (calibration times it)."""
        torch = self.torch
        f = torch.ones(self.target.n_embd, dtype=torch.float16, device=self.device)
        index = torch.tensor(0, device=self.device)

        def step() -> None:
            with torch.inference_mode():
                int(np.argmax(self.net.logits(self.net(f, index)).float().cpu().numpy()))

        return step

    def memory_bytes(self) -> int:
        tensors = sum(t.numel() * t.element_size() for t in self.net.state_dict().values())
        return tensors + self.sub_index.nbytes

    def close(self) -> None:
        self.net = None
