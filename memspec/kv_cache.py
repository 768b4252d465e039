"""KV cache types: what a context stores K and V as, and what a token of it costs.

llama.cpp stores K and V per layer as f16 by default; q8_0 and q4_0 keep blocks of 32 values
with one f16 scale (34 and 18 bytes a block: 1.06 and 0.56 bytes a value, against 2), which is
how llama-server's -ctk/-ctv and Ollama's OLLAMA_KV_CACHE_TYPE stretch a context in little
memory. A quantized V needs flash attention (llama.cpp refuses the context without it).

Sliding-window layers (Gemma 2/3: five layers in six attend to the last 512 tokens only) keep
a cache of the window plus a batch, as llama-server does, unless `swa_full` (llama.cpp's own
default) gives them the whole context: 5× Gemma 3's KV at 32k. A prefix is then reusable only
while its window is still held (the backends check).

    KVCache("q8_0", "q8_0", flash_attn=True).bytes_per_token(n_layers, kv_heads, dk, dv)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVType = Literal["f16", "q8_0", "q4_0"]
KV_TYPES: tuple[KVType, ...] = ("f16", "q8_0", "q4_0")
# (ggml type id, bytes per block, values per block): ggml.h's GGML_TYPE_* and block layouts.
_LAYOUT: dict[str, tuple[int, int, int]] = {
    "f16": (1, 2, 1),
    "q8_0": (8, 34, 32),
    "q4_0": (2, 18, 32),
}


def ggml_type(kv_type: str) -> int:
    """llama.cpp's id for the type (Llama(type_k=..., type_v=...))."""
    return _LAYOUT[kv_type][0]


def row_bytes(kv_type: str, n_values: int) -> int:
    """Bytes of n_values stored as kv_type (a quantized row is whole blocks)."""
    _, block_bytes, block_values = _LAYOUT[kv_type]
    return -(-n_values // block_values) * block_bytes


@dataclass(frozen=True)
class KVCache:
    """A context's KV cache: the types of K and V, and whether attention is flash attention."""

    type_k: KVType = "f16"
    type_v: KVType = "f16"
    flash_attn: bool = False
    swa_full: bool = False

    def __post_init__(self) -> None:
        for name in (self.type_k, self.type_v):
            if name not in _LAYOUT:
                raise ValueError(f"unknown KV cache type {name!r}; known: {', '.join(KV_TYPES)}")
        if self.type_v != "f16" and not self.flash_attn:
            raise ValueError(
                f"a {self.type_v} V cache needs flash attention (flash_attn on or auto)"
            )

    @property
    def quantized(self) -> bool:
        return self.type_k != "f16" or self.type_v != "f16"

    def bytes_per_token(
        self, n_layers: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int
    ) -> int:
        """K and V of every layer for one token (each head's row quantized on its own)."""
        per_layer = n_kv_heads * (
            row_bytes(self.type_k, head_dim_k) + row_bytes(self.type_v, head_dim_v)
        )
        return n_layers * per_layer

    def bytes_at(
        self, n_cells: int, n_layers: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int,
        n_swa: int = 0, swa_layers: int = 0, n_ubatch: int = 512,
    ) -> int:  # fmt: skip
        """A cache of `n_cells` tokens: its full layers hold them all, its sliding-window
        layers (unless swa_full) the window plus a batch, in 256-cell steps (llama.cpp's
        llama_kv_cache_iswa)."""
        one = self.bytes_per_token(1, n_kv_heads, head_dim_k, head_dim_v)
        swa_cells = n_cells
        if swa_layers and not self.swa_full:
            swa_cells = min(n_cells, -(-(n_swa + n_ubatch) // 256) * 256)
        return one * ((n_layers - swa_layers) * n_cells + swa_layers * swa_cells)

    def describe(self) -> str:
        fa = ", flash attention" if self.flash_attn else ""
        swa = ", full-size sliding-window layers" if self.swa_full else ""
        return f"K {self.type_k}, V {self.type_v}{fa}{swa}"


F16 = KVCache()

# llama.cpp's sliding-window pattern per architecture (src/models/<arch>.cpp: every n-th layer
# attends to the whole context, the others to the window), and its default window.
SWA_PATTERNS = {"gemma3": (6, 0), "gemma2": (2, 4096), "cohere2": (4, 0)}


def sliding_window(
    arch: str, n_layers: int, window: int | None, period: int | str | None = None
) -> tuple[int, int]:
    """(window, layers with it) as llama.cpp loads them from a GGUF's `sliding_window` and
    `sliding_window_pattern` (a period; "array": one flag per layer). An architecture not
    known here, or a per-layer array: (0, 0), every layer counted at full size (never less
    than llama.cpp allocates)."""
    if arch not in SWA_PATTERNS or (isinstance(period, str) and not period.isdigit()):
        return 0, 0
    default_period, default_window = SWA_PATTERNS[arch]
    n_swa, p = int(window or default_window), int(period or default_period)
    if n_swa <= 0:
        return 0, 0
    return n_swa, sum(il % p < p - 1 for il in range(n_layers))


def resolve_flash_attn(setting: str, quantized_v: bool, n_gpu_layers: int) -> bool:
    """`flash_attn` auto: on where it is needed (a quantized V) or pays (GPU offload); off on
    a CPU with an f16 cache, where the plain path is what the exactness tests measured."""
    if setting == "on":
        return True
    if setting == "off":
        return False
    return quantized_v or n_gpu_layers != 0
