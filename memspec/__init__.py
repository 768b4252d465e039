"""MemSpec: memory-aware speculative decoding for memory-starved edge devices."""

__version__ = "0.1.0"
