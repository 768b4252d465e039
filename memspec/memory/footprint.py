"""The SpecMemo memory model: bytes one loaded model takes, by part, from its GGUF and n_ctx.

    footprint = weights + KV cache + candidate/logit buffers(k) + scratch + per-context overhead

for the target and for each resident model draft; the budget check sums them. Every part is
computed from the GGUF's hyper-parameters (memspec.memory.gguf_info) and the run settings
(n_ctx, n_batch, k); the two constants below were measured, and the whole model is checked
against psutil RSS/USS deltas of real loads (tests/memory/test_footprint_measured.py).

Where the parts come from (llama.cpp as bundled with llama-cpp-python 0.3.36, CPU, mmap off;
the numbers are what its verbose log prints and what USS grew by, SmolLM2-135M, n_ctx 2048):
- weights: Σ tensor bytes. "CPU model buffer" + "CPU_REPACK model buffer" (Q4_0 weights are
  repacked to 8x8 blocks, same size) = 513.13 MiB for F32, 136.40 MiB for Q8_0,
  28.82 + 56.95 MiB for Q4_0: exactly the GGUF's tensor bytes.
- KV cache: n_ctx × layers × (K + V) × kv_heads × head_dim × 2 bytes (f16; q8_0 and q4_0 store
  blocks of 32 in 34 and 18 bytes: memspec.kv_cache): "CPU KV buffer
  size = 45.00 MiB". llama.cpp zero-fills it at load, so it is resident from the start.
- candidate/logit buffers: llama.cpp's output buffer holds n_outputs × vocab floats (0.19 MiB
  for one row; +1.77 MiB after a k = 8 verification); the engine copies those rows into numpy
  (the same size again). A draft asks for one row per step, the target for k + 1.
- scratch: llama.cpp *reserves* a worst-case compute buffer (99.38 MiB at n_batch 512: its
  graph for 512 outputs) but only touches what the batches it really runs need. The engine
  prefills in n_batch chunks with one output, so the peak is one chunk attending to the whole
  context: attention scores u × n_kv × heads × 4 bytes (no flash attention on the CPU), half
  that again in the CPU backend's work buffer (scores converted to f16 for KQ·V), plus the
  chunk's activations u × (n_embd + 3 × n_ff) × 4. Measured worst case (prefill to n_ctx):
  +8.8 / 21.9 / 37.2 / 67.8 MB at n_ctx 256 / 512 / 1024 / 2048; this formula: 8.9 / 24.7 /
  38.9 / 67.2 MB.
- overhead: the llama.cpp vocabulary (token texts, maps, BPE merges), the Python wrapper and
  its batch arrays: USS at load minus weights minus KV = 19.6 / 20.4 / 21.5 MB at n_ctx
  256 / 512 / 1024 with a 49,152-token vocabulary (a draft loaded beside the target).
- runtime: the first model in a process also maps llama.cpp's code and sets up its backends:
  +12.4 MB RSS (+6.2 MB USS) over the same load beside a resident model. The target is always
  loaded first, so it carries this part.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from memspec.errors import ModelLoadError
from memspec.kv_cache import F16, KVCache
from memspec.memory.gguf_info import ModelShape, read_shape
from memspec.rpc.endpoints import LayerSplit

# Measured (see above): bytes per vocabulary entry that llama.cpp + llama-cpp-python keep per
# loaded model (≈ 20.1 MB / 49,152 tokens), plus half of the llama_batch seq-id arrays
# (n_batch × n_ctx × 4 bytes, allocated per token slot and partly touched).
OVERHEAD_PER_VOCAB_BYTES = 410
BATCH_SEQ_BYTES = 2
# Measured: ΔRSS of a first llama.cpp load in a process minus the same load beside a model.
FIRST_MODEL_BYTES = 12_400_000
# llama.cpp sizes the KV cache in multiples of 256 cells.
KV_PAD = 256
DEFAULT_N_BATCH = 512  # what memspec.backends.llama_cpp passes: min(n_ctx, 512)


def pad(n: int, to: int = KV_PAD) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Footprint:
    """Bytes of one loaded model (or draft), by part."""

    weights: int = 0
    kv: int = 0
    candidates: int = 0  # logit rows: llama.cpp's output buffer + the engine's copy
    scratch: int = 0  # compute buffer pages the engine's batches touch (worst case)
    overhead: int = 0  # vocabulary, wrapper, batch arrays
    runtime: int = 0  # once per process: llama.cpp's code and backends (the target pays it)

    @property
    def total(self) -> int:
        """Steady-state bytes once the model has run its largest batch: what is budgeted."""
        return (
            self.weights + self.kv + self.candidates + self.scratch + self.overhead + self.runtime
        )

    @property
    def at_load(self) -> int:
        """Bytes right after loading, before any batch ran (no scratch touched, one row)."""
        return (
            self.weights + self.kv + self.overhead + self.runtime + min(self.candidates, self._row)
        )

    _row: int = 0  # one logit row (vocab × 4): what the output buffer holds at load

    def to_dict(self) -> dict[str, int]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["total"] = self.total
        d["at_load"] = self.at_load
        return d


def scratch_bytes(
    shape: ModelShape, n_ctx: int, n_batch: int, n_outputs: int = 1, flash_attn: bool = False
) -> int:
    """Peak compute-buffer bytes of the engine's batches (see the module docstring)."""
    n_kv = pad(n_ctx)

    def batch_peak(u: int, outputs: int) -> int:
        if flash_attn:  # scores are never materialised; estimate, not measured here
            attn = u * shape.n_head * (shape.head_dim_k + shape.head_dim_v) * 4
        else:
            attn = u * n_kv * shape.n_head * 4 * 3 // 2
        act = u * (shape.n_embd + 3 * shape.n_ff) * 4
        return attn + act + outputs * shape.n_vocab * 4

    prefill = batch_peak(min(n_batch, n_ctx), 1)  # one chunk at the end of a full context
    verify = batch_peak(min(n_outputs, n_ctx), n_outputs)  # k + 1 rows with logits
    return max(prefill, verify)


def model_footprint(
    shape: ModelShape,
    n_ctx: int,
    n_outputs: int = 1,
    n_batch: int | None = None,
    n_gpu_layers: int = 0,
    kv_cache: KVCache = F16,
) -> Footprint:
    """Footprint of one llama.cpp model + context, asking for up to n_outputs logit rows,
    its KV cache stored as `kv_cache`'s types."""
    n_batch = min(n_batch or DEFAULT_N_BATCH, n_ctx)
    row = shape.n_vocab * 4
    weights = shape.weight_bytes
    if n_gpu_layers != 0 and shape.tied_output:
        # A GPU output layer gets its own copy of the tied embedding (the input lookup stays
        # on the CPU). Unified memory on a Jetson pays both. Not measured here (no CUDA build).
        weights += shape.token_embd_bytes
    return Footprint(
        weights=weights,
        kv=kv_cache.bytes_at(
            pad(n_ctx),
            shape.n_layers,
            shape.n_head_kv,
            shape.head_dim_k,
            shape.head_dim_v,
            shape.n_swa,
            shape.swa_layers,
            n_batch,
        ),  # fmt: skip
        candidates=2 * max(n_outputs, 1) * row,
        scratch=scratch_bytes(shape, n_ctx, n_batch, n_outputs, kv_cache.flash_attn),
        overhead=shape.n_vocab * OVERHEAD_PER_VOCAB_BYTES + n_batch * n_ctx * BATCH_SEQ_BYTES,
        _row=row,
    )


def target_footprint(
    path: str | os.PathLike[str],
    n_ctx: int,
    k: int,
    n_gpu_layers: int = 0,
    slots: int = 1,
    kv_cache: KVCache = F16,
) -> Footprint:
    """The target verifies k drafted tokens + 1 per round: k + 1 logit rows. Loaded first.
    With `slots` sequences decoded together: a KV cache of n_ctx per slot (per-sequence
    streams), logit rows for a round of every slot verifying k + 1 (at most a batch's n_batch),
    and the batch's sequence-id arrays sized by the whole context. Attention scratch stays
    that of one slot's n_ctx: a pass's tokens are split over the streams (measured: 8 slots of
    2048 add 332 MiB to SmolLM2's RSS, 7 more KV caches of 45 MiB and the rows)."""
    rows = k + 1 if slots <= 1 else min(slots * (k + 1), DEFAULT_N_BATCH)
    shape = read_shape(path)
    fp = model_footprint(shape, n_ctx, rows, n_gpu_layers=n_gpu_layers, kv_cache=kv_cache)
    if slots > 1:
        n_batch = min(DEFAULT_N_BATCH, n_ctx)
        fp = replace(
            fp,
            kv=fp.kv * slots,
            overhead=fp.overhead + n_batch * n_ctx * (slots - 1) * BATCH_SEQ_BYTES,
        )
    return replace(fp, runtime=FIRST_MODEL_BYTES)


def draft_footprint(
    kind: str,
    path: Path | None,
    n_ctx: int,
    params: dict | None = None,
    n_gpu_layers: int = 0,
    kv_cache: KVCache = F16,
) -> Footprint:
    """A draft's footprint, as its kind is sized (memspec.drafts.registry: DraftKind.sizing).

    A GGUF model draft: from the file (one logit row per step). Drafts without weights (prompt
    lookup) take nothing beyond the context. Others (e.g. a retrieval datastore) take
    `params.memory_bytes` when the manifest states it, else what their file holds: they are
    read into memory whole (an .npz: its arrays, uncompressed).
    """
    from memspec.drafts.registry import draft_kind

    sizing = draft_kind(kind).sizing
    params = params or {}
    if "memory_bytes" in params:
        return Footprint(weights=int(params["memory_bytes"]))
    if sizing == "gguf":
        if path is None:
            raise ValueError(f"a {kind} draft needs a file")
        return model_footprint(
            read_shape(path), n_ctx, 1, n_gpu_layers=n_gpu_layers, kv_cache=kv_cache
        )
    if sizing == "none" or path is None:
        return Footprint()
    if not path.is_file():
        raise ModelLoadError(f"draft file not found: {path}", param="draft")
    if sizing == "head":  # its float16 tensors, plus the token -> sub-vocabulary index
        from memspec.drafts.head import head_bytes

        return Footprint(weights=head_bytes(path))
    if zipfile.is_zipfile(path):  # .npz: arrays are held uncompressed once loaded
        with zipfile.ZipFile(path) as z:
            return Footprint(weights=sum(i.file_size for i in z.infolist()))
    return Footprint(weights=path.stat().st_size)


def split_footprint(
    fp: Footprint, shape: ModelShape, split: LayerSplit
) -> tuple[Footprint, dict[str, int]]:
    """A target split over RPC workers: (what this device holds, bytes per worker).

    llama.cpp places n_layers + 1 units (the repeating layers, then the output layer) and
    offloads the last ones: this device keeps the input embeddings and the first
    `split.local` layers; the workers hold the rest in endpoint order, the last one the output
    layer (a copy of the embeddings when they are tied). Each layer's KV cache lives with it.
    Buffers, logit rows and the process overhead stay here; a worker's own compute buffer is
    its to budget."""
    out_bytes = 0 if shape.tied_output else shape.token_embd_bytes
    per_layer = (shape.weight_bytes - shape.token_embd_bytes - out_bytes) / shape.n_layers
    kv_per_layer = fp.kv / shape.n_layers
    remote: dict[str, int] = {}
    layer = split.local
    last = max((i for i, n in enumerate(split.remote) if n), default=-1)
    for i, (endpoint, units) in enumerate(zip(split.endpoints, split.remote, strict=True)):
        has_output = i == last
        layers = min(units, shape.n_layers - layer)  # the output unit is not a layer
        layer += layers
        output = shape.token_embd_bytes if has_output else 0
        remote[endpoint] = round(layers * (per_layer + kv_per_layer)) + output
    local_layers = min(split.local, shape.n_layers)
    weights = shape.token_embd_bytes + round(local_layers * per_layer)
    if last < 0:  # nothing offloaded: the output layer stays too
        weights += out_bytes
    return replace(fp, weights=weights, kv=round(local_layers * kv_per_layer)), remote


def vocab_bytes(shape: ModelShape) -> int:
    """The llama.cpp vocabulary's part of the overhead: held by the loaded model."""
    return shape.n_vocab * OVERHEAD_PER_VOCAB_BYTES


def on_loaded_weights(fp: Footprint, shape: ModelShape) -> Footprint:
    """A context over a model another holder loaded (memspec.backends.shared_weights): the
    weights and the vocabulary are the model's, held once; the context adds its KV cache, logit
    rows, scratch and batch arrays. Measured: the 0.5B Qwen joined at n_ctx 512 adds 11 MiB of
    RSS at load, where its own load adds 528 MiB."""
    return replace(fp, weights=0, overhead=max(0, fp.overhead - vocab_bytes(shape)), runtime=0)


def embedding_footprint(
    shape: ModelShape,
    n_ctx: int,
    n_batch: int,
    shares_weights: bool,
    n_gpu_layers: int = 0,
) -> Footprint:
    """An embedding context (memspec.backends.embedding): its KV cache of n_ctx, an output
    buffer of n_batch rows of logits *and* features (embeddings mode outputs every token of a
    batch), and the scratch of a batch with every row out. On the target's model
    (`shares_weights`) it adds no weights and no vocabulary; its own model adds both."""
    fp = model_footprint(shape, n_ctx, n_batch, n_batch=n_batch, n_gpu_layers=n_gpu_layers)
    rows = n_batch * (shape.n_vocab + shape.n_embd) * 4  # llama.cpp's output buffer, no copy
    if shares_weights:
        return replace(fp, weights=0, candidates=rows, overhead=0, _row=0)
    return replace(fp, candidates=rows, overhead=vocab_bytes(shape))
