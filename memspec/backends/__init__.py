"""Model backends: one interface, llama-cpp-python first, torch/transformers second."""

from memspec.backends.base import Backend, BackendOptions, load_backend

__all__ = ["Backend", "BackendOptions", "load_backend"]
