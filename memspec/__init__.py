"""MemSpec: memory-aware speculative decoding for memory-starved edge devices."""

import os

__version__ = "0.1.0"

# ggml reads this once, at its first matmul, so it is set before any memspec code runs a model:
# its tiled K-quant matmul sums a batch in another order than one row, which would break
# lossless verification (memspec.backends.llama_cpp). An operator who sets it to 1 trades that
# for batch speed, and `batch_invariant` then says so.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")
