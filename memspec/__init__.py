"""MemSpec: memory-aware speculative decoding for memory-starved edge devices."""

import os

__version__ = "0.1.0"

# ggml reads this once, at its first matmul, so it is set before any memspec code runs a model:
# its tiled K-quant matmul sums a batch in another order than one row, which would break
# lossless verification (memspec.backends.llama_cpp). An operator who sets it to 1 trades that
# for batch speed, and `batch_invariant` then says so.
# Whether the value is ours (not the operator's): a llama-server the bench starts as its peer
# runs llama.cpp's own kernels, as its users run it (memspec.bench.peer_server).
TILED_MM_SET_BY_MEMSPEC = "GGML_CPU_TILED_MM" not in os.environ
os.environ.setdefault("GGML_CPU_TILED_MM", "0")
