"""Build, cache, install and *prove* the llama-cpp-python library that MemSpec runs on.

Run by scripts/setup.sh with the virtualenv's python (memspec itself need not be installed):

    python scripts/llama_build.py                    # build or reuse a wheel, install it
    python scripts/llama_build.py --probe-model M    # ... then run every model kind on it

Why a probe: a `GGML_NATIVE` build compiles for the building CPU, and on a Xeon that advertises
AMX it produced a library that ran the F32 target but died with SIGILL (`tilezero`, the AMX
path of libggml-cpu) on the first quantized model. So after installing, each model kind the pool
uses (F32, Q8_0, Q4_0, Q2_K and the source's own type) is quantized from the testbed model,
loaded and run in a subprocess of its own. A crash marks that wheel's cache entry as crashing
and the library is rebuilt without `GGML_NATIVE`, with the CPU's ISA named explicitly and AMX
off; that build is probed too, and setup fails loudly rather than leave a crashing library.

The outcome lands in `.venv/.memspec-llama.json`, which `memspec doctor` and the daemon's
status report ("which kernels run").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = Path(sys.prefix) / ".memspec-llama.json"
# The model kinds the draft pool uses; the probe model's own type is run as well.
PROBE_FTYPES = ("F32", "Q8_0", "Q4_0", "Q2_K")
# x86 ISA extensions a non-native build may name: /proc/cpuinfo flag -> ggml CMake option.
X86_ISA = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def log(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def llama_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    marker = '"llama-cpp-python=='
    start = text.index(marker) + len(marker)
    return text[start : text.index('"', start)]


def cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def primary_cmake_args(batch_invariant: bool, user_args: str) -> str:
    """The first build tried: native for this CPU, llamafile off unless opted out, and ggml's
    RPC backend on (`memspec rpc-worker`, a target split over devices: docs/rpc.md)."""
    args = f"-DGGML_LLAMAFILE=OFF {user_args}" if batch_invariant else user_args
    return f"-DGGML_RPC=ON {args}".strip() if "GGML_RPC" not in args else args


def fallback_cmake_args(primary: str, cpu_line: str, machine: str) -> str:
    """A build that never executes an instruction the probe did not see run: no GGML_NATIVE,
    the CPU's own ISA named one by one (so speed stays close to native), AMX off."""
    flags = set(cpu_line.split(":", 1)[-1].split())
    args = [primary.strip(), "-DGGML_NATIVE=OFF"]
    if machine in ("x86_64", "AMD64", "i686"):
        args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in X86_ISA.items()]
        args += [f"-D{opt}=OFF" for opt in AMX_OFF]
    return " ".join(a for a in args if a)


def wheel_key(version: str, cmake_args: str, cpu_line: str) -> str:
    python = f"Python {platform.python_version()}"
    text = "|".join((version, cmake_args, python, platform.machine(), cpu_line))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def wheel_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memspec" / "wheels"


@dataclass
class ProbeResult:
    ok: bool
    runs: dict[str, str] = field(default_factory=dict)  # model kind -> "ok" or the failure

    @property
    def failure(self) -> str:
        return "; ".join(f"{kind}: {why}" for kind, why in self.runs.items() if why != "ok")


def describe_exit(rc: int, stderr: str) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"crashed with {name}"
    tail = stderr.strip().splitlines()[-1:] or [""]
    return f"exit {rc}: {tail[0][:200]}"


def probe_library(model: Path, ftypes: tuple[str, ...] = PROBE_FTYPES) -> ProbeResult:
    """Quantize `model` to each type and decode with it, every step in its own subprocess."""
    result = ProbeResult(ok=True)
    with tempfile.TemporaryDirectory(prefix="memspec-probe-") as tmp:
        kinds = [("source", str(model))] + [(ft, str(Path(tmp) / f"{ft}.gguf")) for ft in ftypes]
        for kind, path in kinds:
            cmd = [sys.executable, __file__, "--probe-one", path]
            if kind != "source":
                cmd += ["--quantize-from", str(model), "--ftype", kind]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            why = "ok" if proc.returncode == 0 else describe_exit(proc.returncode, proc.stderr)
            result.runs[kind] = why
            result.ok = result.ok and why == "ok"
            log(f"probe {kind:<6} {why}")
            if kind != "source" and os.path.exists(path):
                os.unlink(path)  # an F32 copy is ~0.5 GB; keep one at a time
    return result


def probe_one(path: str, quantize_from: str | None, ftype: str | None) -> None:
    """In a subprocess: (quantize and) load one model, run a batch and single steps."""
    import llama_cpp

    if quantize_from:
        params = llama_cpp.llama_model_quantize_default_params()
        prefix = "LLAMA_FTYPE_ALL_" if ftype == "F32" else "LLAMA_FTYPE_MOSTLY_"
        params.ftype = getattr(llama_cpp, prefix + str(ftype))
        params.allow_requantize = True
        rc = llama_cpp.llama_model_quantize(quantize_from.encode(), path.encode(), params)
        if rc != 0:
            raise SystemExit(f"quantize to {ftype} failed ({rc})")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog.")
    llm.eval(tokens)  # one batch
    for _ in range(4):  # single steps
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])


@dataclass
class Outcome:
    version: str
    cmake_args: str
    key: str
    fallback_reason: str = ""
    probe: dict[str, str] = field(default_factory=dict)


def read_outcome(path: Path = STAMP) -> Outcome | None:
    try:
        return Outcome(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def library_ok(version: str, batch_invariant: bool) -> bool:
    """The installed llama_cpp imports, has the pinned version, and llamafile off if wanted."""
    code = (
        "import llama_cpp, sys\n"
        "info = llama_cpp.llama_print_system_info().decode(errors='replace')\n"
        f"wrong = llama_cpp.__version__ != {version!r}\n"
        f"sys.exit(wrong or ({batch_invariant} and 'LLAMAFILE = 1' in info))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def build_wheel(version: str, cmake_args: str, dest: Path) -> None:
    log(f"building llama-cpp-python {version} with CMAKE_ARGS='{cmake_args}' (~5 min on 2 cores)")
    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-cache-dir",
         "--no-binary", "llama-cpp-python", "-w", str(part), f"llama-cpp-python=={version}"],
        env=env, check=True,
    )  # fmt: skip
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)


def install_wheel(wheel_dir: Path) -> None:
    whl = str(next(wheel_dir.glob("llama_cpp_python-*.whl")))
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--force-reinstall", "--no-deps", whl], check=True)
    subprocess.run(pip + [whl], check=True)  # its dependencies, in a fresh venv


def ensure(
    probe_model: Path | None,
    *,
    batch_invariant: bool = True,
    user_args: str = "",
    cpu_line: str | None = None,
    cache: Path | None = None,
    build: Callable[[str, str, Path], None] = build_wheel,
    install: Callable[[Path], None] = install_wheel,
    probe: Callable[[Path], ProbeResult] = probe_library,
    is_ok: Callable[[str, bool], bool] = library_ok,
    stamp: Path = STAMP,
) -> Outcome:
    """Leave a llama-cpp-python installed that runs (probed when a model is given)."""
    version = llama_version()
    cpu_line = cpu_flags_line() if cpu_line is None else cpu_line
    cache = cache or wheel_cache()
    candidates = [primary_cmake_args(batch_invariant, user_args)]
    candidates.append(fallback_cmake_args(candidates[0], cpu_line, platform.machine()))
    reason = ""
    for args in candidates:
        key = wheel_key(version, args, cpu_line)
        crashed = cache / f"{key}.crashed"
        if crashed.exists():  # a build proven to crash on this CPU is never installed again
            reason = crashed.read_text().strip()
            continue
        current = read_outcome(stamp)
        if not (current and current.key == key and is_ok(version, batch_invariant)):
            wheels = cache / key
            if not any(wheels.glob("llama_cpp_python-*.whl")):
                build(version, args, wheels)
            install(wheels)
            if not is_ok(version, batch_invariant):
                raise SystemExit(f"[setup] llama-cpp-python built with '{args}' does not import")
            current = Outcome(version, args, key, reason)
        current.fallback_reason = reason
        if probe_model is not None and not current.probe:
            result = probe(probe_model)
            if not result.ok:
                reason = f"CMAKE_ARGS '{args}' {result.failure}"
                crashed.parent.mkdir(parents=True, exist_ok=True)
                crashed.write_text(reason + "\n")
                log(f"this build crashes; rebuilding without it ({reason})")
                stamp.unlink(missing_ok=True)
                continue
            current.probe = result.runs
        stamp.write_text(json.dumps(asdict(current), indent=1) + "\n")
        return current
    raise SystemExit(f"[setup] no llama-cpp-python build runs on this CPU: {reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe-model", type=Path, help="GGUF to quantize and run on the build")
    ap.add_argument("--probe-one", help=argparse.SUPPRESS)
    ap.add_argument("--quantize-from", help=argparse.SUPPRESS)
    ap.add_argument("--ftype", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_one:
        probe_one(a.probe_one, a.quantize_from, a.ftype)
        return
    outcome = ensure(
        a.probe_model,
        batch_invariant=os.environ.get("MEMSPEC_BATCH_INVARIANT", "1") == "1",
        user_args=os.environ.get("CMAKE_ARGS", ""),
    )
    if outcome.fallback_reason:
        log(f"llama-cpp-python: fallback build '{outcome.cmake_args}'")


if __name__ == "__main__":
    main()
