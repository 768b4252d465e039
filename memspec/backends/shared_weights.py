"""One loaded llama_model per file, shared by every backend that loads the same weights.

A model can be wanted in two roles at once: Qwen2.5-Coder 0.5B served by name, and as the
1.5B's sibling draft. llama.cpp allows several contexts over one `llama_model` (read-only
once loaded), so the second load takes the first one's weights and only adds its own
context: its KV cache and buffers. The weights are freed when the last holder closes.

    handle = SHARED_MODELS.open(key, role, load)   # load() runs only for the first holder
    handle.close()                                 # the last close frees the model

Who pays for shared weights in the budget is the footprint model's question
(memspec.memory.footprint): the target role pays, a draft riding on a served model's
weights pays its context only. `held_as(path, role)` is what it asks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memspec.backends.base import BackendOptions

# What makes two loads the same weights: the file, and the load parameters that change
# where and how the tensors are stored (repacked CPU buffers, offloaded layers, RPC devices).
WeightsKey = tuple[str, bool, int, bool, tuple[str, ...]]


def weights_key(path: Path, options: BackendOptions) -> WeightsKey:
    """Loads with equal keys share one model; a load with `share_weights` off gets a key of
    its own (a load whose cost is being measured must read the file)."""
    name = str(path.resolve())
    if not options.share_weights:
        name += f"\x00private-{next(_private)}"
    return (name, options.weight_repack, options.n_gpu_layers, options.use_mmap, options.rpc)


_private = itertools.count()


@dataclass
class _Loaded:
    model: Any  # llama_cpp._internals.LlamaModel
    roles: dict[int, str] = field(default_factory=dict)  # handle id -> role
    notes: dict[str, Any] = field(default_factory=dict)  # what the first load's log said


class SharedModel:
    """One holder's reference to a shared llama_model. It stands in for the LlamaModel that
    llama_cpp.Llama keeps (attribute reads go to the model); `close()` releases this holder
    only, once."""

    def __init__(self, registry: SharedModels, key: WeightsKey, loaded: _Loaded, fresh: bool):
        self._registry, self._key, self._loaded = registry, key, loaded
        self.fresh = fresh  # this holder loaded the weights (False: it joined a load)
        self.notes = loaded.notes
        self._open = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loaded.model, name)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._registry._release(self._key, id(self))


class SharedModels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[WeightsKey, _Loaded] = {}

    def open(self, key: WeightsKey, role: str, load: Callable[[], Any]) -> SharedModel:
        """A reference to the weights `key` names, loading them (`load()`) if no one holds them.
        Loads are serialised by the caller (backends.llama_cpp holds its parameter lock)."""
        with self._lock:
            loaded = self._loaded.get(key)
        fresh = loaded is None
        if loaded is None:
            loaded = _Loaded(load())  # raises before anything is registered
            with self._lock:
                self._loaded[key] = loaded
        handle = SharedModel(self, key, loaded, fresh)
        with self._lock:
            loaded.roles[id(handle)] = role
        return handle

    def _release(self, key: WeightsKey, handle_id: int) -> None:
        with self._lock:
            loaded = self._loaded.get(key)
            if loaded is None:
                return
            loaded.roles.pop(handle_id, None)
            last = not loaded.roles
            if last:
                del self._loaded[key]
        if last:
            loaded.model.close()

    def held_as(self, key: WeightsKey, role: str) -> bool:
        """Whether the weights `key` names are loaded now by a holder in `role`."""
        with self._lock:
            loaded = self._loaded.get(key)
            return loaded is not None and role in loaded.roles.values()

    def holders(self, path: Path) -> list[str]:
        """The roles holding `path`'s weights now, one per holder (any load parameters)."""
        name = str(path.resolve())
        with self._lock:
            return [r for k, v in self._loaded.items() if k[0] == name for r in v.roles.values()]


SHARED_MODELS = SharedModels()
