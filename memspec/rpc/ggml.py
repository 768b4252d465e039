"""ggml's RPC backend, as the llama-cpp-python that setup builds (`-DGGML_RPC=ON`) ships it.

llama-cpp-python binds llama.h, not ggml-rpc.h: the few functions used here are declared with
ctypes against the libraries in `llama_cpp/lib`. Two caveats from ggml-rpc.cpp shape the rest
of memspec/rpc: the protocol has no authentication (a worker binds loopback unless told
otherwise), and a client that cannot reach or loses its server calls GGML_ABORT, which ends the
process (hence the target's own process: memspec/backends/isolated.py)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from memspec.errors import DeviceUnavailable

GGML_BACKEND_DEVICE_TYPE_CPU = 0


def _lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


@functools.cache
def library() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libggml, libggml-rpc) with the signatures used; DeviceUnavailable when the installed
    llama-cpp-python was built without the RPC backend."""
    import llama_cpp  # noqa: F401 - loads libggml and its backends first

    path = _lib_dir() / "libggml-rpc.so"
    if not path.is_file():
        raise DeviceUnavailable(
            "the installed llama-cpp-python has no RPC backend (built without -DGGML_RPC=ON): "
            "rerun scripts/setup.sh",
            code="rpc_unavailable",
        )
    ggml = ctypes.CDLL(str(_lib_dir() / "libggml.so"))
    rpc = ctypes.CDLL(str(path))
    p = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = (
        [ctypes.c_int],
        p,
    )
    ggml.ggml_backend_reg_dev_count.argtypes, ggml.ggml_backend_reg_dev_count.restype = (
        [p],
        ctypes.c_size_t,
    )
    ggml.ggml_backend_reg_dev_get.argtypes = [p, ctypes.c_size_t]
    ggml.ggml_backend_reg_dev_get.restype = p
    ggml.ggml_backend_dev_count.argtypes, ggml.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes, ggml.ggml_backend_dev_get.restype = [ctypes.c_size_t], p
    ggml.ggml_backend_dev_type.argtypes, ggml.ggml_backend_dev_type.restype = [p], ctypes.c_int
    ggml.ggml_backend_dev_description.argtypes = [p]
    ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
    rpc.ggml_backend_rpc_add_server.argtypes, rpc.ggml_backend_rpc_add_server.restype = (
        [ctypes.c_char_p],
        p,
    )
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(p)
    ]  # fmt: skip
    rpc.ggml_backend_rpc_start_server.restype = None
    return ggml, rpc


def remote_devices(endpoint: str) -> list[int]:
    """The ggml devices a worker at `endpoint` serves (connects: the caller checks that it is
    reachable first, since ggml aborts the process on a failed connection)."""
    ggml, rpc = library()
    reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        raise DeviceUnavailable(f"rpc worker {endpoint}: ggml could not register it")
    return [
        ggml.ggml_backend_reg_dev_get(reg, i) for i in range(ggml.ggml_backend_reg_dev_count(reg))
    ]


def serving_devices() -> list[int]:
    """What a worker serves, as llama.cpp's rpc-server does: its accelerators (a Jetson's
    GPU, in a CUDA build), else its CPU. RPC devices registered in this process are not its
    own to serve."""
    ggml, _ = library()
    own = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        desc = (ggml.ggml_backend_dev_description(dev) or b"").decode(errors="replace")
        if ggml.ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU and "RPC" not in desc:
            own.append(dev)
    return own or [cpu_device()]


def cpu_device() -> int:
    ggml, _ = library()
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise DeviceUnavailable("ggml has no CPU device", code="rpc_unavailable")
    return dev


def start_server(endpoint: str, cache_dir: str | None, n_threads: int, devices: list[int]) -> None:
    """Serve `devices` at `endpoint` until the process ends (ggml's accept loop never returns
    unless the socket cannot be created)."""
    _, rpc = library()
    arr = (ctypes.c_void_p * len(devices))(*devices)
    rpc.ggml_backend_rpc_start_server(
        endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devices), arr
    )
