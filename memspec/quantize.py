"""llama.cpp's quantizer (llama-cpp-python's `llama_model_quantize`), run for /api/create's
`quantize` with progress, in a child process.

    quantize(src, dst, "Q4_K_M", progress=lambda done, total: ...)

The child keeps the daemon safe from the quantizer: a crash in llama.cpp (a CPU feature it
mis-detects, an allocation that fails) ends the child, not the daemon; its logs (every tensor,
on llama.cpp's log callback) never reach the daemon's own stderr; it runs at a lower priority
than serving. Progress is read from the quantizer's own per-tensor lines (`[  12/ 272]`), which
the child turns into one JSON line each on its stdout.

Names are Ollama's (`q4_K_M`, `Q8_0`, `f16`: case does not matter). As in Ollama, only an
unquantized model (F32, F16, BF16) is quantized: requantizing loses twice.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from memspec.errors import InvalidRequest, MemSpecError

# The llama_ftype values (llama.h) of the types llama.cpp quantizes to without an importance
# matrix, by Ollama's names upper-cased.
QUANT_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
    "Q5_K_M": 17, "Q6_K": 18, "BF16": 32,
}  # fmt: skip
UNQUANTIZED = {0: "F32", 1: "F16", 32: "BF16"}  # what may be quantized (Ollama's rule)

_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")
_LOG_TAIL = 40  # lines of the quantizer's log kept for an error message


class QuantizeError(MemSpecError):
    """The quantizer failed or crashed: the output is gone, the source untouched."""


def quant_type(name: str) -> tuple[str, int]:
    """(Ollama's name upper-cased, llama_ftype) for a `quantize` value; InvalidRequest for a
    type llama.cpp cannot make here (Ollama's words: unsupported quantization type)."""
    key = name.strip().upper()
    if key not in QUANT_TYPES:
        raise InvalidRequest(
            f"unsupported quantization type {name[:40]}: one of {', '.join(QUANT_TYPES)}",
            param="quantize",
        )
    return key, QUANT_TYPES[key]


def quantize(
    src: Path,
    dst: Path,
    type_name: str,
    progress: Callable[[int, int], None] | None = None,
    *,
    n_threads: int = 0,
    cancel: threading.Event | None = None,
) -> None:
    """Quantize the GGUF `src` into `dst` (written whole, or removed) as `type_name`, calling
    `progress(tensors done, tensors in all)` as it goes. QuantizeError on any failure;
    `cancel` set stops the child. n_threads 0: llama.cpp's choice (every core)."""
    name, ftype = quant_type(type_name)
    cmd = [sys.executable, "-m", "memspec.quantize", str(src), str(dst), str(ftype), str(n_threads)]
    tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
    )
    # stderr drains on a thread of its own: a chatty child must never block on a full pipe.
    drain = threading.Thread(target=lambda: tail.extend(proc.stderr or ()), daemon=True)
    drain.start()
    stopper = None
    if cancel is not None:
        stopper = threading.Thread(target=_stop_on, args=(cancel, proc), daemon=True)
        stopper.start()
    try:
        for line in proc.stdout or ():
            try:
                event = json.loads(line)
            except ValueError:
                tail.append(line)
                continue
            if progress is not None and isinstance(event, dict) and "tensor" in event:
                progress(int(event["tensor"]), int(event["tensors"]))
        rc = proc.wait()
        drain.join(5)
    except BaseException:
        proc.kill()
        proc.wait()
        dst.unlink(missing_ok=True)
        raise
    if rc != 0:
        dst.unlink(missing_ok=True)
        if cancel is not None and cancel.is_set():
            raise QuantizeError(f"quantizing {src.name} to {name} was cancelled")
        why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        detail = "".join(tail).strip()[-1500:]
        raise QuantizeError(
            f"quantizing {src.name} to {name} failed ({why})" + (f": {detail}" if detail else "")
        )


def _stop_on(cancel: threading.Event, proc: subprocess.Popen[str]) -> None:
    while proc.poll() is None:
        if cancel.wait(0.2):
            proc.kill()
            return


def file_type(path: Path) -> int | None:
    """The GGUF's general.file_type (a llama_ftype), None when the header has none."""
    from memspec.drafts.gguf_header import open_header, scalar

    value = scalar(open_header(path), "general.file_type")
    return int(value) if isinstance(value, int) else None


# --- the child --------------------------------------------------------------------------------


def _child(src: str, dst: str, ftype: int, n_threads: int) -> int:
    import ctypes

    import llama_cpp

    try:
        os.nice(10)  # serving first: the quantizer takes what the daemon leaves
    except OSError:
        pass
    log: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL)

    @llama_cpp.llama_log_callback
    def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        m = _TENSOR_LINE.match(line)
        if m:
            print(json.dumps({"tensor": int(m[1]), "tensors": int(m[2])}), flush=True)
        elif line.strip():
            log.append(line)

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    params.allow_requantize = False  # only F32/F16/BF16 come here (the caller checked)
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.stderr.write("".join(log))
        Path(dst).unlink(missing_ok=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
