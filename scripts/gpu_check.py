"""Issue 40's device check: the CUDA build of llama-cpp-python and what a GPU changes.

Run through scripts/gpu_check.sh, in three ways:

    scripts/gpu_check.sh --prepare   # here: gather what must travel into gpu_carry/ (< 64 MiB)
    scripts/gpu_check.sh             # on a lent GPU machine: build, then measure (JSON to $OUT)
    scripts/gpu_check.sh --cpu       # the CPU proof: the same steps on this box's .venv build

On the GPU machine (no network; nvcc, CMake, ninja and PyTorch there) `run` makes a venv that
sees the image's packages, installs the carried wheels, builds llama-cpp-python from the carried
sdist with `-DGGML_CUDA=on` for the card's compute capability (the CPU part without
GGML_NATIVE, AMX off: scripts/llama_build.py's fallback flags), and proves it with
llama_build.probe_library. Beside the build it writes random-weight GGUFs shaped like
Qwen2.5-1.5B, Qwen2.5-0.5B (then Q4_K_M) and SmolLM2-135M, from the published architectures and
the real tokenizers (carried as metadata-only GGUFs: the weights never travel). Then:
- verify: 1..9 rows in one batch at 128 tokens of context, median of N, and the per-token
  draft cost, for both Qwen shapes with every layer offloaded;
- lossless: greedy output of every draft kind (prompt lookup, Q8_0/Q4_0/Q2_K self-drafts,
  auto) against plain decoding on the SmolLM2 shape; any divergence with its top-2 margin;
- runtime: `memspec bench runtime`'s own-cost figures with the target's step on the GPU;
- torch: the torch backend on CUDA (transformers' model built from the SmolLM2 architecture's
  GGUF with random weights), greedy equality of drafts against plain;
- pytest: tests/engine/test_speculative.py's lossless tests against the random target.
Each step runs in a subprocess with a timeout cut from one deadline (the device gives a command
10 minutes); a failure is recorded in the JSON and the independent steps go on. The JSON is
rewritten after every step, so a run cut short still leaves what it measured.

Timing does not depend on weight values, so random weights measure the real shapes' costs;
acceptance and output quality are not measured here (a random model's output is noise).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CARRY = Path(os.environ.get("GPU_CHECK_CARRY") or ROOT / "gpu_carry")
CARRY_LIMIT = 64 << 20  # the device tool's limit on everything that travels
DEFAULT_WORK = Path(tempfile.gettempdir()) / "memspec-gpu-check"
# Wheels the device image lacks (its package list: the device tool's KINDS.md), or holds in a
# version memspec was not tested with; pure Python but pydantic-core. Versions: this .venv's.
CARRY_WHEELS = (
    "gguf", "pydantic", "pydantic-core", "pydantic-settings", "annotated-types",
    "typing-inspection", "typing-extensions", "python-dotenv", "fastapi", "starlette",
    "uvicorn", "tomli-w", "diskcache", "scikit-build-core",
)  # fmt: skip
DEVICE_PYTHON = "3.12"  # the device image's python3 (KINDS.md)
# What a llama.cpp build never reads: the sdist is 73 MiB, mostly these (git pack, vocab files).
TRIM = (".git/",) + tuple(
    f"vendor/llama.cpp/{d}/"
    for d in ("docs", "benches", "media", "tools/ui", "tests", "examples", "gguf-py", "conversion",
              "pocs")
)  # fmt: skip
VENDOR_QWEN_VOCAB = "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def _llama_build() -> Any:
    """scripts/llama_build.py: the project's build flags and its probe, reused as they are."""
    spec = importlib.util.spec_from_file_location(
        "llama_build", ROOT / "scripts" / "llama_build.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llama_build"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# --- the shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A published architecture, as llama.cpp's GGUF names it (checked against the real files
    by `prepare` and tests/scripts/test_gpu_check.py where those files are present)."""

    name: str
    arch: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    qkv_bias: bool  # Qwen2 has biases on q, k, v
    tied: bool  # no output.weight: the token embedding is the output layer
    tokenizer: str  # the carried tokenizer metadata (gpu_carry/tokenizers/<name>.gguf)
    real_file: str  # the real model in data/models this shape is read off, where present

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tensors(self, n_vocab: int, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every tensor; numpy order is ggml's reversed."""
        e, kv = self.n_embd, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", (n_vocab, e)), ("output_norm.weight", (e,))]
        if not self.tied:
            out.append(("output.weight", (n_vocab, e)))
        for i in range(self.n_layer if layers is None else min(layers, self.n_layer)):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, e)),
                    (b + "attn_k.weight", (kv, e)), (b + "attn_v.weight", (kv, e)),
                    (b + "attn_output.weight", (e, e)), (b + "ffn_norm.weight", (e,)),
                    (b + "ffn_gate.weight", (self.n_ff, e)), (b + "ffn_up.weight", (self.n_ff, e)),
                    (b + "ffn_down.weight", (e, self.n_ff))]  # fmt: skip
            if self.qkv_bias:
                out += [(b + "attn_q.bias", (e,)), (b + "attn_k.bias", (kv,)),
                        (b + "attn_v.bias", (kv,))]  # fmt: skip
        return out

    def hparams(self, layers: int | None = None) -> dict[str, int | float]:
        """The architecture keys the real file carries (under `{arch}.`)."""
        h: dict[str, int | float] = {
            "block_count": self.n_layer if layers is None else min(layers, self.n_layer),
            "context_length": self.n_ctx_train,
            "embedding_length": self.n_embd,
            "feed_forward_length": self.n_ff,
            "attention.head_count": self.n_head,
            "attention.head_count_kv": self.n_head_kv,
            "rope.freq_base": self.rope_base,
            "attention.layer_norm_rms_epsilon": self.rms_eps,
        }
        if self.arch == "llama":
            h["rope.dimension_count"] = self.head_dim
        return h


SHAPES = {
    s.name: s
    for s in (
        Shape(
            "qwen2.5-1.5b",
            "qwen2",
            1536,
            8960,
            28,
            12,
            2,
            32768,
            1e6,
            1e-6,
            True,
            False,
            "qwen2.5",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        Shape(
            "qwen2.5-0.5b",
            "qwen2",
            896,
            4864,
            24,
            14,
            2,
            32768,
            1e6,
            1e-6,
            True,
            False,
            "qwen2.5",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        Shape(
            "smollm2-135m",
            "llama",
            576,
            1536,
            30,
            9,
            3,
            8192,
            1e5,
            1e-5,
            False,
            True,
            "smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )  # fmt: skip
}
QWEN_TARGET, QWEN_DRAFT, SMOL = "qwen2.5-1.5b", "qwen2.5-0.5b", "smollm2-135m"
# The testbed's names (tests/launcher.py, drafts/*.toml): the random SmolLM2 stands in for the
# real one wherever the engine's tests and manifests look for it.
SMOL_TARGET_FILE = "smollm2-135m-f32.gguf"
SMOL_DRAFT_FILES = {"q8_0": "smollm2-135m-q8_0.gguf", "q4_0": "smollm2-135m-q4_0.gguf",
                    "q2_k": "smollm2-135m-q2_k.gguf"}  # fmt: skip
SMOL_TORCH_DRAFT = "smollm2-135m-f16.gguf"


def qwen_file(name: str) -> str:
    return f"{name}-random-q4_k_m.gguf"


def models_dir_of(real: Path | None = None) -> Path:
    if real is not None:
        return real
    env = os.environ.get("MEMSPEC_DATA_DIR")
    return (Path(env) if env else ROOT / "data") / "models"


def check_shape(shape: Shape, path: Path) -> list[str]:
    """Where the real GGUF at `path` differs from `shape` (hyper-parameters, tensor names and
    shapes): empty when the random model is the real one's twin."""
    from memspec.drafts.gguf_header import open_header, scalar

    r = open_header(path)  # the header only, arrays unparsed: GGUFReader takes seconds
    diffs = []
    for key, want in shape.hparams().items():
        got = scalar(r, f"{shape.arch}.{key}")
        if got is None or abs(float(got) - float(want)) > 1e-6 * max(abs(float(want)), 1.0):
            diffs.append(f"{shape.arch}.{key}: real {got}, shape {want}")
    real = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    mine = dict(shape.tensors(int(scalar(r, "tokenizer.ggml.tokens"))))
    for name in sorted(set(real) | set(mine)):
        if real.get(name) != mine.get(name):
            diffs.append(f"{name}: real {real.get(name)}, shape {mine.get(name)}")
    return diffs


# --- random GGUFs ----------------------------------------------------------------------------


def tokenizer_fields(src: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, item type) of every tokenizer.* field of `src`. Arrays are decoded
    from their raw bytes (memspec.drafts.gguf_header): GGUFReader makes a numpy view of each
    of 151,936 tokens, seconds per file."""
    import struct

    import numpy as np
    from gguf import GGUFValueType as T

    from memspec.drafts.gguf_header import open_header

    numeric = {T.INT32: "<i4", T.UINT32: "<u4", T.FLOAT32: "<f4", T.INT8: "<i1", T.UINT8: "<u1",
               T.INT64: "<i8", T.UINT64: "<u8", T.FLOAT64: "<f8"}  # fmt: skip
    r = open_header(src)
    out = []
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype != T.ARRAY:
            out.append((key, field.contents(), vtype, None))
            continue
        item, n, blob = field.types[-1], int(field.parts[-2][0]), bytes(field.parts[-1])
        if item == T.STRING:
            values, offs = [], 0
            for _ in range(n):  # u64 length, then the bytes
                size = struct.unpack_from("<Q", blob, offs)[0]
                values.append(blob[offs + 8 : offs + 8 + size])
                offs += 8 + size
        elif item in numeric:
            values = np.frombuffer(blob, dtype=numeric[item], count=n).tolist()
        else:
            raise ValueError(f"{src.name}: {key} is an array of {item.name}")
        out.append((key, values, vtype, item))
    return out


def copy_tokenizer(src: Path, writer: Any) -> int:
    """Every tokenizer.* field of `src` into `writer`; returns the vocabulary size."""
    n_vocab = 0
    for key, value, vtype, item in tokenizer_fields(src):
        writer.add_key_value(key, value, vtype, item)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def write_tokenizer_gguf(src: Path, dst: Path, arch: str) -> None:
    """A metadata-only GGUF holding `src`'s tokenizer (a few MB for a 151,936-token vocab)."""
    from gguf import GGUFWriter

    dst.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(dst), arch)
    copy_tokenizer(src, w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def write_random_gguf(
    dst: Path,
    shape: Shape,
    tokenizer: Path,
    dtype: str = "F16",
    layers: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A GGUF of `shape` with random weights (std 0.02, norms 1) and the real tokenizer.

    Values come from one random pool reused at a random offset per tensor: a 1.5B model's
    3 GB are written at disk speed instead of drawing 1.5e9 normal numbers."""
    import numpy as np
    from gguf import GGUFWriter

    t0 = time.perf_counter()
    np_dtype = np.dtype(np.float16 if dtype == "F16" else np.float32)
    w = GGUFWriter(str(dst), shape.arch)
    w.add_name(f"{shape.name} random weights (memspec gpu_check)")
    for key, value in shape.hparams(layers).items():
        if isinstance(value, float):
            w.add_float32(f"{shape.arch}.{key}", value)
        else:
            w.add_uint32(f"{shape.arch}.{key}", value)
    w.add_file_type(1 if dtype == "F16" else 0)  # llama_ftype: MOSTLY_F16 / ALL_F32
    n_vocab = copy_tokenizer(tokenizer, w)
    if shape.arch == "llama":
        w.add_uint32("llama.vocab_size", n_vocab)
    tensors = shape.tensors(n_vocab, layers)
    f32 = np.dtype(np.float32)

    def dtype_of(shp: tuple[int, ...]) -> Any:  # norms and biases stay F32, as converters write
        return f32 if len(shp) == 1 else np_dtype

    for name, shp in tensors:
        w.add_tensor_info(name, shp, dtype_of(shp), int(np.prod(shp)) * dtype_of(shp).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal((1 << 24) + 7, dtype=np.float32) * 0.02).astype(np_dtype)
    params = 0
    for name, shp in tensors:
        n = int(np.prod(shp))
        params += n
        if name.endswith("norm.weight"):
            data = np.ones(n, dtype=np_dtype)
        else:
            start = int(rng.integers(0, len(pool)))
            if start + n <= len(pool):
                data = pool[start : start + n]
            else:  # np.resize repeats the (rotated) pool up to n values
                data = np.resize(np.roll(pool, -start), n)
        w.write_tensor_data(data.astype(dtype_of(shp), copy=False).reshape(shp))
    w.close()
    return {
        "file": dst.name,
        "dtype": dtype,
        "layers": shape.hparams(layers)["block_count"],
        "params": params,
        "bytes": dst.stat().st_size,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def quantize(src: Path, dst: Path, ftype: str) -> dict[str, Any]:
    """llama.cpp's quantizer (`llama_model_quantize`) on every core."""
    import llama_cpp

    t0 = time.perf_counter()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"quantize {src.name} to {ftype} failed ({rc})")
    return {
        "file": dst.name,
        "bytes": dst.stat().st_size,
        "seconds": round(time.perf_counter() - t0, 2),
    }


# --- prepare (here) --------------------------------------------------------------------------


def find_sdist(version: str, given: Path | None) -> Path:
    """The llama-cpp-python sdist: given, else the local package mirrors, else PyPI (pip)."""
    name = f"llama_cpp_python-{version}.tar.gz"
    if given is not None:
        return given
    for base in (Path("/opt/pypi/files"), Path("/opt/pypi-more/files"), Path.home() / ".cache"):
        hits = sorted(base.rglob(name)) if base.is_dir() else []
        if hits:
            return hits[0]
    dest = Path(tempfile.mkdtemp(prefix="gpu-check-sdist-"))
    log(f"downloading the sdist of llama-cpp-python {version} (pip download, ~75 MB)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "-d", str(dest), f"llama-cpp-python=={version}"],
        check=True,
    )  # fmt: skip
    return next(dest.glob("llama_cpp_python-*.tar.gz"))


def trim_sdist(src: Path, dst: Path) -> dict[str, Any]:
    """The sdist without what no build reads (git objects, docs, tests, vocab test files),
    streamed member by member; also hands back llama.cpp's Qwen2 vocab file's bytes (the
    tokenizer fallback when the real Qwen model is absent)."""
    kept = dropped = 0
    vocab: bytes | None = None
    tmp = dst.with_suffix(".part")
    with tarfile.open(src, "r:gz") as tin, tarfile.open(tmp, "w:gz", compresslevel=6) as tout:
        for m in tin:
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if rel == VENDOR_QWEN_VOCAB:
                f = tin.extractfile(m)
                vocab = f.read() if f else None
            drop = any(rel.startswith(p) or rel == p.rstrip("/") for p in TRIM) or (
                rel.startswith("vendor/llama.cpp/models/") and rel.endswith(".gguf")
            )
            if drop:
                dropped += m.size
                continue
            kept += m.size
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    tmp.replace(dst)
    return {"kept_bytes": kept, "dropped_bytes": dropped, "qwen_vocab": vocab}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheels(dest: Path) -> dict[str, str]:
    """This .venv's version of each CARRY_WHEELS package (the newest where the .venv has none:
    scikit-build-core, which pip builds with in isolation), as a wheel for the device's Python."""
    from importlib.metadata import PackageNotFoundError, version

    dest.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("-")[0].lower().replace("_", "-"): p.name for p in dest.glob("*.whl")}
    wanted = []
    for name in CARRY_WHEELS:
        try:
            wanted.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            wanted.append(name)
    missing = [w for w in wanted if w.split("==")[0] not in have]
    if missing:
        log(f"pip download for Python {DEVICE_PYTHON}: {' '.join(missing)}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux2014_x86_64", "-d", str(dest), *missing],
            check=True,
        )  # fmt: skip
    return sorted(p.name for p in dest.glob("*.whl"))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worktree_bytes() -> int:
    """What travels besides the carry: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    files = [ROOT / p.decode() for p in out.split(b"\0") if p]
    return sum(f.stat().st_size for f in files if f.is_file())


def prepare(sdist: Path | None, models: Path | None) -> int:
    lb = _llama_build()
    version = lb.llama_version()
    CARRY.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"llama_cpp_python": version, "made": time.strftime("%F %T")}
    src = find_sdist(version, sdist)
    trimmed = CARRY / f"llama_cpp_python-{version}-trimmed.tar.gz"
    trim = trim_sdist(src, trimmed)
    vocab = trim.pop("qwen_vocab")
    manifest["sdist"] = {"source": str(src), "sha256": sha256(src), "file": trimmed.name, **trim}
    log(f"sdist {src.name} trimmed to {trimmed.stat().st_size >> 20} MiB")
    manifest["wheels"] = download_wheels(CARRY / "wheels")

    mdir = models_dir_of(models)
    toks: dict[str, Any] = {}
    for key, arch in (("smollm2", "llama"), ("qwen2.5", "qwen2")):
        real = [mdir / s.real_file for s in SHAPES.values() if s.tokenizer == key]
        source = next((p for p in real if p.is_file()), None)
        dst = CARRY / "tokenizers" / f"{key}.gguf"
        if source is None and key == "qwen2.5" and vocab:
            # llama.cpp's own Qwen2 vocab test file: the same 151,936 tokens and merges.
            source = Path(tempfile.mkdtemp()) / "ggml-vocab-qwen2.gguf"
            source.write_bytes(vocab)
        if source is None:
            log(f"no {key} model in {mdir} to take its tokenizer from: run scripts/setup.sh")
            return 1
        write_tokenizer_gguf(source, dst, arch)
        toks[key] = {"source": source.name, "bytes": dst.stat().st_size}
    manifest["tokenizers"] = toks
    # The bench workloads' prompts (data/ does not travel: it is ignored).
    for rel in ("human_eval/HumanEval.jsonl.gz", "mt_bench/question.jsonl"):
        src_file = mdir.parent / rel
        if src_file.is_file():
            (CARRY / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src_file, CARRY / "data" / rel)
    manifest["data"] = sorted(str(p.relative_to(CARRY)) for p in (CARRY / "data").rglob("*.*"))
    # The shapes against the real files (a random twin must have the real tensors).
    checks = {}
    for s in SHAPES.values():
        real = mdir / s.real_file
        checks[s.name] = check_shape(s, real) if real.is_file() else "real file absent"
        if checks[s.name] and checks[s.name] != "real file absent":
            log(f"{s.name} differs from {real.name}: {checks[s.name][:3]}")
            return 1
    manifest["shape_checks"] = {k: v or "same as the real file" for k, v in checks.items()}
    carry = tree_bytes(CARRY)
    total = carry + worktree_bytes()
    manifest["carry_bytes"], manifest["travel_bytes"] = carry, total
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"gpu_carry/: {carry / 2**20:.1f} MiB; with the working tree {total / 2**20:.1f} MiB")
    if total > CARRY_LIMIT:
        log(f"over the device tool's {CARRY_LIMIT >> 20} MiB: trim more")
        return 1
    return 0


# --- steps (each in a subprocess of the venv's python) ---------------------------------------


@dataclass
class Profile:
    """How much each step does: the device's numbers, or the CPU proof's (2 shared cores)."""

    n_gpu_layers: int
    n_threads: int | None  # None: every core; 1 on the shared CPU box (a spinning pool stalls)
    qwen_layers: int | None  # None: the real depth
    verify_reps: int
    lossless_tokens: int
    lossless_prompts: int
    lossless_ks: tuple[int, ...]
    lossless_drafts: tuple[str, ...]
    runtime_args: tuple[str, ...]
    torch_device: str
    torch_tokens: int
    pytest_k: str  # a -k expression over tests/engine/test_speculative.py


GPU_PROFILE = Profile(
    n_gpu_layers=-1, n_threads=None, qwen_layers=None, verify_reps=15, lossless_tokens=40,
    lossless_prompts=3,
    lossless_ks=(1, 2, 4, 8), lossless_drafts=("prompt-lookup", "q8_0", "q4_0", "q2_k"),
    runtime_args=("--prompts", "3", "--max-tokens", "64", "--stub-tokens", "256"),
    torch_device="cuda", torch_tokens=32,
    pytest_k="every_draft_and_k or adaptive or rollback",
)  # fmt: skip
CPU_PROFILE = Profile(
    n_gpu_layers=0, n_threads=1, qwen_layers=2, verify_reps=2, lossless_tokens=8,
    lossless_prompts=2,
    lossless_ks=(3,), lossless_drafts=("prompt-lookup", "q4_0"),
    runtime_args=("--prompts", "1", "--max-tokens", "16", "--stub-tokens", "64",
                  "--sweep-mib", "16"),
    torch_device="cpu", torch_tokens=8, pytest_k="rollback",
)  # fmt: skip
PROMPTS = [
    "Extract the names from this sentence: Alice met Bob and Carol at the station, then Alice "
    "and Carol took the train.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three benefits of regular exercise?",
]


def step_models_write(work: Path, prof: Profile) -> dict[str, Any]:
    """Random F16 Qwen shapes and the SmolLM2 shape in F32 (the testbed target's type) and F16
    (the torch self-draft): everything that needs no llama.cpp, so it runs beside the build."""
    models = work / "data" / "models"
    models.mkdir(parents=True, exist_ok=True)
    tok = CARRY / "tokenizers"
    out: dict[str, Any] = {}
    smol = SHAPES[SMOL]
    # What a previous run on this machine wrote is kept (a second run resumes).
    # The F16 torch draft has the F32 target's weights (same seed): a self-draft.
    jobs: list[tuple[str, Path, Shape, str, str, int | None, Path | None]] = [
        (SMOL, models / SMOL_TARGET_FILE, smol, "smollm2", "F32", None, None),
        ("torch_draft", models / SMOL_TORCH_DRAFT, smol, "smollm2", "F16", None, None),
    ]
    for name in (QWEN_TARGET, QWEN_DRAFT):
        f16 = models / f"{name}-random-f16.gguf"
        jobs.append(
            (name, f16, SHAPES[name], "qwen2.5", "F16", prof.qwen_layers, models / qwen_file(name))
        )
    for key, dst, shape, tok_name, dtype, layers, done in jobs:
        if dst.is_file() or (done is not None and done.is_file()):
            out[key] = {"file": dst.name, "kept": True}
            continue
        tmp = dst.with_suffix(".part")
        out[key] = write_random_gguf(tmp, shape, tok / f"{tok_name}.gguf", dtype, layers, seed=1)
        tmp.replace(dst)
        out[key]["file"] = dst.name
    return out


def step_models_quantize(work: Path, prof: Profile) -> dict[str, Any]:
    """Q4_K_M of the Qwen shapes; the SmolLM2 self-drafts under the testbed's names."""
    models = work / "data" / "models"
    out: dict[str, Any] = {}
    for name in (QWEN_TARGET, QWEN_DRAFT):
        f16 = models / f"{name}-random-f16.gguf"
        if not f16.is_file() and (models / qwen_file(name)).is_file():
            out[name] = {"file": qwen_file(name), "kept": True}
            continue
        out[name] = quantize(f16, models / qwen_file(name), "Q4_K_M")
        f16.unlink()  # 3 GB for the 1.5B: keep the disk for what follows
    for ftype, file in SMOL_DRAFT_FILES.items():
        out[ftype] = quantize(models / SMOL_TARGET_FILE, models / file, ftype)
    return out


def step_library(work: Path, prof: Profile) -> dict[str, Any]:
    """Which llama.cpp this is: version, backends, whether layers can go to a GPU."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return {
        # On the device a build that cannot offload is a failed build.
        "ok": offload or prof.n_gpu_layers == 0,
        "version": llama_cpp.__version__,
        "gpu_offload": offload,
        "system_info": info.strip(),
        "cuda_in_system_info": "CUDA" in info,
    }


def step_probe(work: Path, prof: Profile) -> dict[str, Any]:
    """llama_build.probe_library on the random SmolLM2 shape: every model kind the pool uses,
    quantized and run on this build's CPU path, each in a subprocess (a SIGILL is caught)."""
    result = _llama_build().probe_library(work / "data" / "models" / SMOL_TARGET_FILE)
    return {"ok": result.ok, "runs": result.runs}


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 4)


def time_costs(be: Any, reps: int, context: int) -> tuple[dict[int, list[float]], list[float]]:
    """Seconds of 1..9 rows in one batch (each row's argmax read, sizes in turns: up, then
    down) and of one draft token (no row read: calibration.measure_draft's step), at `context`
    tokens of context, `reps` times each."""
    ctx = list(range(1000, 1000 + context))
    sizes = list(range(1, 10))
    be.reset()
    be.eval(ctx, all_logits=False)

    def once(batch: int, rows: bool) -> float:
        t = time.perf_counter()
        if rows:
            be.eval_argmax(ctx[:batch])
        else:
            be.eval(ctx[:batch], all_logits=False)
        s = time.perf_counter() - t
        be.truncate(context)
        return s

    for b in sizes * 2:  # warm-up: kernels' first launch, CUDA graphs' capture
        once(b, True)
    once(1, False)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    draft: list[float] = []
    for rep in range(reps):
        for b in sizes if rep % 2 == 0 else sizes[::-1]:
            times[b].append(once(b, True))
        draft.append(once(1, False))
    be.reset()
    return times, draft


def step_verify(work: Path, prof: Profile) -> dict[str, Any]:
    """The verify curve (1..9 rows in one batch) and the per-token draft cost of each Qwen
    shape, as memspec.engine.calibration measures them, the raw medians kept."""
    from memspec.backends.base import BackendOptions, load_backend
    from memspec.engine.calibration import CONTEXT_TOKENS, non_decreasing

    models = work / "data" / "models"
    out: dict[str, Any] = {"context_tokens": CONTEXT_TOKENS, "reps": prof.verify_reps}
    for name in (QWEN_TARGET, QWEN_DRAFT):
        t0 = time.perf_counter()
        be = load_backend(
            models / qwen_file(name),
            BackendOptions(n_ctx=512, n_gpu_layers=prof.n_gpu_layers, n_threads=prof.n_threads),
        )
        load_s = time.perf_counter() - t0
        try:
            times, draft = time_costs(be, prof.verify_reps, CONTEXT_TOKENS)
            med = [_median_ms(ts) for ts in times.values()]
            out[name] = {
                "file": qwen_file(name),
                "describe": {k: str(v) for k, v in be.describe().items()},
                "load_s": round(load_s, 2),
                "verify_ms": {str(b): m for b, m in zip(times, med, strict=True)},
                "verify_ms_min": {str(b): round(min(ts) * 1e3, 4) for b, ts in times.items()},
                "verify_ms_non_decreasing": [round(v, 4) for v in non_decreasing(med)],
                "draft_ms_per_token": _median_ms(draft),
                "rows5_over_rows1": round(med[4] / med[0], 3),
            }
        finally:
            be.close()
    t, d = out[QWEN_TARGET], out[QWEN_DRAFT]
    out["sibling_draft_share_of_target_step"] = round(
        d["draft_ms_per_token"] / t["verify_ms"]["1"], 3
    )
    return out


def _runtime(work: Path, prof: Profile, drafts: list[str]) -> Any:
    from memspec.config import Settings
    from memspec.paths import use_data_dir
    from memspec.runtime import Runtime

    use_data_dir(work / "data")
    settings = Settings.load(
        target=SMOL_TARGET_FILE, drafts=drafts, n_ctx=1024, n_gpu_layers=prof.n_gpu_layers,
        n_threads=prof.n_threads, state_dir=str(work / "state"),
    )  # fmt: skip
    return Runtime(settings)


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def top2_margin(backend: Any, prompt: list[int], ref: list[int], i: int) -> float:
    """The target's top-2 logit margin where plain decoding chose ref[i]."""
    import numpy as np

    backend.reset()
    row = backend.eval(prompt + ref[:i], all_logits=False)[-1]
    backend.reset()
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def compare_greedy(
    generate: Callable[[list[int], str, int | None], list[int]],
    backend: Any,
    prompts: list[list[int]],
    runs: list[tuple[str, int | None]],
    label: str,
) -> dict[str, Any]:
    """Plain decoding's tokens against every (draft, k) run; each divergence with its margin."""
    refs = [generate(p, "none", None) for p in prompts]
    divergences: list[dict[str, Any]] = []
    checked = 0
    for draft, k in runs:
        for n, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
            got = generate(prompt, draft, k)
            checked += 1
            log(f"{label}: {draft} k={k} prompt {n}: {len(got)} tokens")
            i = first_divergence(ref, got)
            if i is None:
                continue
            d: dict[str, Any] = {"draft": draft, "k": k, "prompt": n, "token": i}
            if i < len(ref) and i < len(got):
                d.update(plain=ref[i], spec=got[i], margin=top2_margin(backend, prompt, ref, i))
            divergences.append(d)
            log(f"{label}: {draft} k={k} prompt {n} differs at token {i}: {d}")
    return {
        "runs": checked,
        "identical": checked - len(divergences),
        "divergences": divergences,
        "reference_lengths": [len(r) for r in refs],
        "all_identical": not divergences,
    }


def step_lossless(work: Path, prof: Profile) -> dict[str, Any]:
    """Greedy output of every draft kind against plain decoding (the daemon's path: Runtime)."""
    from memspec.engine.sampling import SamplingParams

    drafts = list(prof.lossless_drafts)
    rt = _runtime(work, prof, drafts)
    try:
        params = SamplingParams(max_tokens=prof.lossless_tokens)
        prompts = [
            rt.requests.prompt_tokens(messages=[{"role": "user", "content": p}])
            for p in PROMPTS[: prof.lossless_prompts]
        ]
        proposed = accepted = 0

        def generate(prompt: list[int], draft: str, k: int | None) -> list[int]:
            nonlocal proposed, accepted
            gen = rt.generate(prompt, params, draft=draft, k=k)
            proposed, accepted = proposed + gen.proposed, accepted + gen.accepted
            return gen.token_ids

        runs = [(d, k) for d in drafts for k in prof.lossless_ks] + [("auto", None)]
        out = compare_greedy(generate, rt.target, prompts, runs, "lossless")
        out.update(
            proposed=proposed,
            accepted=accepted,
            target=rt.target.describe(),
            costs_verify_ms=[round(s * 1e3, 4) for s in rt.costs.verify_s],
        )
        return out
    finally:
        rt.close()


def step_runtime(work: Path, prof: Profile) -> dict[str, Any]:
    """`memspec bench runtime` with the target's step on the device (no llama-server here)."""
    report = work / "runtime_bench.json"
    cmd = [sys.executable, "-m", "memspec.cli", "bench", "runtime",
           "--target", str(work / "data" / "models" / SMOL_TARGET_FILE),
           "--n-gpu-layers", str(prof.n_gpu_layers), "--no-peer-server",
           "--out", str(report), *prof.runtime_args]  # fmt: skip
    if prof.n_threads:
        cmd += ["--n-threads", str(prof.n_threads)]
    env = dict(os.environ, MEMSPEC_DATA_DIR=str(work / "data"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"bench runtime exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    r = json.loads(report.read_text())
    plain = r["real"]["systems"]["memspec"]
    stub = {
        mode: {
            name: {
                "own_ms_per_token": c["own_ms_per_token"],
                "own_ms_per_round": c["own_ms_per_round"],
            }
            for name, c in r["stub"][mode]["configs"].items()
        }
        for mode in ("warm", "cold")
    }
    return {
        "report": report.name,
        "plain_ms_per_token": plain["ms_per_token"],
        "plain_split_ms_per_token": plain["split_ms_per_token"],
        "own_ms_per_token": plain["own_ms_per_token"],
        "identical_to_plain": {n: s["identical_to_plain"] for n, s in r["real"]["systems"].items()},
        "stub_own_cost": stub,
        "goal_ms": r["stub"]["goal_ms"],
    }


def step_torch(work: Path, prof: Profile) -> dict[str, Any]:
    """The torch backend (transformers' model from the SmolLM2 architecture's GGUF, random
    weights) on the device: greedy output with prompt lookup and a torch self-draft against
    plain decoding, as tests/backends/test_torch_hf.py checks it on the CPU."""
    from memspec.backends.base import BackendOptions, load_backend
    from memspec.drafts.model import ModelDraft
    from memspec.drafts.prompt_lookup import PromptLookupDraft
    from memspec.engine.policy import FixedPolicy
    from memspec.engine.sampling import SamplingParams
    from memspec.engine.speculative import speculative_generate

    models = work / "data" / "models"
    opts = BackendOptions(n_ctx=512, device=prof.torch_device, n_threads=1)
    t0 = time.perf_counter()
    target = load_backend(models / SMOL_TARGET_FILE, opts, kind="torch")
    draft_be = load_backend(models / SMOL_TORCH_DRAFT, opts, kind="torch")
    load_s = time.perf_counter() - t0
    drafts = {"prompt-lookup": PromptLookupDraft(), "torch-f16": ModelDraft("torch-f16", draft_be)}
    try:
        params = SamplingParams(max_tokens=prof.torch_tokens)
        prompts = [
            target.tokenize(target.chat_prompt([{"role": "user", "content": p}]), special=True)
            for p in PROMPTS[:2]
        ]

        def generate(prompt: list[int], draft: str, k: int | None) -> list[int]:
            policy = FixedPolicy(drafts.get(draft), k or 0)
            return speculative_generate(target, prompt, params, policy).token_ids

        t1 = time.perf_counter()
        runs = [(d, k) for d in drafts for k in (1, 3, 6)]
        out = compare_greedy(generate, target, prompts, runs, "torch")
        out.update(
            describe={k: str(v) for k, v in target.describe().items()},
            load_s=round(load_s, 2),
            compare_s=round(time.perf_counter() - t1, 2),
        )
        return out
    finally:
        target.close()
        draft_be.close()


def step_pytest(work: Path, prof: Profile) -> dict[str, Any]:
    """tests/engine/test_speculative.py's lossless tests with the random SmolLM2 as the
    testbed target (MEMSPEC_DATA_DIR) and its layers on the device (MEMSPEC_N_GPU_LAYERS)."""
    env = dict(
        os.environ,
        MEMSPEC_DATA_DIR=str(work / "data"),
        MEMSPEC_N_GPU_LAYERS=str(prof.n_gpu_layers),
    )
    if prof.n_threads:
        env["MEMSPEC_N_THREADS"] = str(prof.n_threads)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
           "tests/engine/test_speculative.py", "-k", prof.pytest_k]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    sys.stdout.write("\n".join(tail[-60:]) + "\n")
    return {"exit": proc.returncode, "ok": proc.returncode == 0, "summary": tail[-1:] or [""]}


STEPS: dict[str, Callable[[Path, Profile], dict[str, Any]]] = {
    "models-write": step_models_write,
    "models-quantize": step_models_quantize,
    "library": step_library,
    "probe": step_probe,
    "verify": step_verify,
    "lossless": step_lossless,
    "runtime": step_runtime,
    "torch": step_torch,
    "pytest": step_pytest,
}


def run_step(name: str, work: Path, cpu: bool, out: Path) -> int:
    prof = CPU_PROFILE if cpu else GPU_PROFILE
    t0 = time.perf_counter()
    result = STEPS[name](work, prof)
    result.setdefault("ok", True)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


# --- the orchestrator (device: the image's python3; --cpu: the .venv's) ----------------------


_WRITING = threading.Lock()


class Report:
    """The JSON written after every step, so that a run cut short keeps what it measured."""

    def __init__(self, path: Path, mode: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.data: dict[str, Any] = {
            "check": "memspec gpu_check (issue 40)",
            "mode": mode,
            "started": time.strftime("%F %T %Z"),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                     "python": sys.version.split()[0]},
            "steps": {},
        }  # fmt: skip
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def put(self, name: str, result: dict[str, Any]) -> dict[str, Any]:
        with _WRITING:  # the steps beside the build report from a thread of their own
            self.data["steps"][name] = result
            self.save()
        status = "ok" if result.get("ok") else f"FAILED: {result.get('error', '')}"
        log(f"step {name}: {status} ({result.get('seconds', '?')} s)")
        return result

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1][-400:]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[-600:]
    except OSError:
        return ""


class StepRunner:
    """Steps in subprocesses of `python`, each with a timeout cut from the report's deadline;
    their output goes to one log."""

    def __init__(self, python: Path, work: Path, cpu: bool, logfile: Path, env: dict[str, str]):
        self.python, self.work, self.cpu, self.logfile, self.env = python, work, cpu, logfile, env

    def start(
        self, name: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path, Path, float]:
        res = self.work / "steps" / f"{name}.json"
        res.parent.mkdir(parents=True, exist_ok=True)
        res.unlink(missing_ok=True)
        slog = self.work / "steps" / f"{name}.log"
        cmd = [str(self.python), str(Path(__file__).resolve()), "step", name,
               "--work", str(self.work), "--result", str(res)]  # fmt: skip
        if self.cpu:
            cmd.append("--cpu")
        with open(slog, "wb") as f:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env or self.env, stdout=f, stderr=subprocess.STDOUT
            )
        return proc, res, slog, time.perf_counter()

    def finish(
        self, started: tuple[subprocess.Popen[bytes], Path, Path, float], name: str, timeout: float
    ) -> dict[str, Any]:
        proc, res, slog, t0 = started
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        with _WRITING, open(self.logfile, "a") as out:
            out.write(f"\n===== step {name} =====\n" + slog.read_text(errors="replace"))
        seconds = round(time.perf_counter() - t0, 2)
        if rc is None:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": seconds,
                    "log_tail": _tail(slog)}  # fmt: skip
        if rc != 0 or not res.is_file():
            return {"ok": False, "error": f"exit {rc}: {_tail(slog, 1)}", "seconds": seconds,
                    "log_tail": _tail(slog, 8)}  # fmt: skip
        return json.loads(res.read_text())

    def run(self, name: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        return self.finish(self.start(name, env), name, timeout)


def gpu_info() -> dict[str, Any]:
    q = "name,compute_cap,driver_version,memory.total"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()  # fmt: skip
    name, cap, driver, mem = (s.strip() for s in out[0].split(","))
    return {"gpus": len(out), "name": name, "compute_cap": cap, "driver": driver, "memory": mem,
            "cuda_arch": cap.replace(".", "")}  # fmt: skip


def make_venv(venv: Path) -> Path:
    """A venv of the image's python3 that sees the image's packages (torch, transformers,
    numpy, pip) through a .pth line: `--system-site-packages` would see the base interpreter's
    (the image's python3 is itself a venv), and `--without-pip` needs no ensurepip (Debian's
    and Ubuntu's pythons lack it). The carried wheels go in without their dependencies."""
    import site

    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_dir = next((venv / "lib").glob("python3*/site-packages"))
    (site_dir / "_image_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheels = sorted(str(p) for p in (CARRY / "wheels").glob("*.whl"))
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", *wheels],
        check=True,
    )  # fmt: skip
    return py


@dataclass
class CudaLibs:
    """What CMake is told so that llama.cpp's CUDA build finds cuBLAS and the driver library,
    and where the built library finds them at run time. This workplace's CUDA toolkit is
    assembled from NVIDIA's pip wheels (nvcc, cudart, no cuBLAS, no libcuda stub): cuBLAS is
    then taken from the Python packages beside PyTorch (nvidia/cu13/{include,lib}), which have
    no unversioned libcublas.so to link against, so a shim folder of symlinks provides one."""

    home: Path
    nvcc: str
    cmake_args: list[str]
    lib_dirs: list[str]
    notes: dict[str, str]


def _first(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _pip_cublas(python: Path) -> tuple[Path, Path] | None:
    """(include, lib) of an NVIDIA cuBLAS wheel on `python`'s path (or $GPU_CHECK_CUBLAS)."""
    roots = [Path(os.environ["GPU_CHECK_CUBLAS"])] if os.environ.get("GPU_CHECK_CUBLAS") else []
    code = "import sys; print('\\n'.join(sys.path))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout
    for entry in out.split():
        roots += sorted(Path(entry).glob("nvidia/*")) if Path(entry).is_dir() else []
    for root in roots:
        if (root / "include" / "cublas_v2.h").is_file() and list(
            (root / "lib").glob("libcublas.so*")
        ):
            return root / "include", root / "lib"
    return None


def locate_cuda_libs(nvcc: str, python: Path, work: Path) -> CudaLibs:
    cands = [
        os.environ.get("CUDA_HOME"),
        str(Path(nvcc).resolve().parent.parent),
        "/usr/local/cuda",
    ]
    home = next(
        Path(c)
        for c in [*cands, "/usr/local/cuda"]
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file()
    )
    real_nvcc = home / "bin" / "nvcc"
    tk_libs = [
        d
        for d in (home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib")
        if d.is_dir()
    ]
    shim = work / "cuda-shim"
    shim.mkdir(parents=True, exist_ok=True)
    args: list[str] = []
    lib_dirs = [str(d) for d in tk_libs]
    notes: dict[str, str] = {"toolkit": str(home)}

    def link(name: str, target: Path) -> Path:
        (shim / name).unlink(missing_ok=True)
        (shim / name).symlink_to(target)
        return shim / name

    if (home / "include" / "cublas_v2.h").is_file() and _first(
        [d / "libcublas.so" for d in tk_libs]
    ):
        notes["cublas"] = "the toolkit's"
    elif (pip := _pip_cublas(python)) is not None:
        inc, lib = pip
        blas = _first(sorted(lib.glob("libcublas.so.*"), reverse=True))
        blas_lt = _first(sorted(lib.glob("libcublasLt.so.*"), reverse=True))
        assert blas and blas_lt, lib
        args += [f"-DCUDA_cublas_LIBRARY={link('libcublas.so', blas)}",
                 f"-DCUDA_cublasLt_LIBRARY={link('libcublasLt.so', blas_lt)}",
                 f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]  # fmt: skip
        lib_dirs.append(str(lib))
        notes["cublas"] = f"pip wheel's, {lib}"
    else:
        notes["cublas"] = "not found: the configure will fail"
    # The driver library (CUDA::cuda_driver, for llama.cpp's VMM pool): the toolkit's stub, else
    # the driver's own, else VMM off (cudart then loads the driver at run time).
    stub = _first(
        [d / "stubs" / "libcuda.so" for d in tk_libs] + [d / "libcuda.so" for d in tk_libs]
    )
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    known = [Path(w) for w in ldconfig.split() if "/libcuda.so" in w]
    dirs = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
    driver = _first(known + [Path(d) / n for d in dirs for n in ("libcuda.so", "libcuda.so.1")])
    if stub is not None:
        notes["driver"] = f"stub {stub}"
    elif driver is not None:
        args.append(f"-DCUDA_cuda_driver_LIBRARY={link('libcuda.so', driver)}")
        notes["driver"] = str(driver)
    else:
        args.append("-DGGML_CUDA_NO_VMM=ON")
        notes["driver"] = "no libcuda found: GGML_CUDA_NO_VMM"
    return CudaLibs(home, str(real_nvcc if real_nvcc.is_file() else nvcc), args, lib_dirs, notes)


def cuda_cmake_args(arch: str, libs: CudaLibs) -> str:
    """The CUDA build's CMAKE_ARGS: scripts/llama_build.py's (RPC on, llamafile off, then its
    fallback: no GGML_NATIVE, this CPU's ISA named, AMX off: a native build SIGILLed on an AMX
    host) plus CUDA for this card only; mtmd and NCCL left out (nothing here uses them)."""
    lb = _llama_build()
    cuda = (f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={arch} -DCMAKE_CUDA_COMPILER={libs.nvcc} "
            f"-DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF {' '.join(libs.cmake_args)}")  # fmt: skip
    primary = lb.primary_cmake_args(True, cuda)
    return lb.fallback_cmake_args(primary, lb.cpu_flags_line(), platform.machine())


def unpack_source(work: Path) -> Path:
    version = _llama_build().llama_version()
    src = work / "src"
    tree = src / f"llama_cpp_python-{version}"
    if not tree.is_dir():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(CARRY / f"llama_cpp_python-{version}-trimmed.tar.gz") as t:
            t.extractall(src, filter="data")
    return tree


def build_cuda_wheel(py: Path, work: Path, args: str, logfile: Path, timeout: float) -> Path:
    """pip wheel from the carried source, offline, with the venv's scikit-build-core."""
    tree = unpack_source(work)
    dest = work / "wheel"
    shutil.rmtree(dest, ignore_errors=True)
    env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    with open(logfile, "wb") as f:
        subprocess.run(
            [str(py), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
             "--disable-pip-version-check", "-w", str(dest),
             # a build dir of its own: a second run on a warm machine resumes the compile
             f"--config-settings=build-dir={work / 'skbuild'}", str(tree)],
            env=env, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=timeout,
        )  # fmt: skip
    return next(dest.glob("llama_cpp_python-*.whl"))


def cuda_configure(work: Path, libs: CudaLibs, timeout: float, logfile: Path) -> dict[str, Any]:
    """The CPU proof of the CUDA build's configuration: CMake on the carried (trimmed) source
    with the device's CMAKE_ARGS, then one CUDA object compiled for sm_90 by this nvcc."""
    tree = unpack_source(work)
    build = work / "cuda-configure"
    shutil.rmtree(build, ignore_errors=True)
    args = cuda_cmake_args("90", libs).split()
    t0 = time.perf_counter()
    with open(logfile, "wb") as f:
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *args],
                       stdout=f, stderr=subprocess.STDOUT, check=True, timeout=timeout)  # fmt: skip
        configured = time.perf_counter() - t0
        target = "vendor/llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/acc.cu.o"
        subprocess.run(["ninja", "-C", str(build), target], stdout=f, stderr=subprocess.STDOUT,
                       check=True, timeout=max(timeout - configured, 10))  # fmt: skip
    obj = build / target
    return {"cmake_args": " ".join(args), "cuda_libs": libs.notes,
            "configure_s": round(configured, 1),
            "compiled": target, "object_bytes": obj.stat().st_size,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def find_nvcc() -> str | None:
    hit = shutil.which("nvcc")
    if hit:
        return hit
    cand = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "nvcc"
    return str(cand) if cand.is_file() else None


# After the library and the models: (step, cap in seconds), the closing note's figures first.
PLAN = [("library", 60), ("models-quantize", 150), ("verify", 150), ("lossless", 180),
        ("runtime", 120), ("probe", 90), ("pytest", 150)]  # fmt: skip
NEEDS_QUANTIZED = {"verify", "lossless", "runtime", "pytest"}
RESERVE_S = 210  # what the build leaves for the steps after it
FLOOR_S = 20  # a step with less than this left is skipped, not started to be killed


def orchestrate(a: argparse.Namespace) -> int:
    cpu = a.cpu
    out_dir = Path(a.out or os.environ.get("OUT") or ROOT / "out" / "gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    budget = a.budget or (900.0 if cpu else 560.0)
    report = Report(out_dir / ("gpu_check_cpu.json" if cpu else "gpu_check.json"),
                    "cpu" if cpu else "cuda", time.monotonic() + budget)  # fmt: skip
    logfile = out_dir / "gpu_check.log"
    logfile.write_text("")
    manifest = CARRY / "manifest.json"
    if not manifest.is_file():
        log("gpu_carry/ missing: run scripts/gpu_check.sh --prepare first")
        return 2
    report.data["carry"] = json.loads(manifest.read_text())
    # memspec, and the lab for `memspec bench runtime` (carried as source: lab/ is tracked).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lab")]),
               PYTHONUNBUFFERED="1",
               MEMSPEC_DATA_DIR=str(work / "data"))  # fmt: skip
    if (CARRY / "data").is_dir():  # the workloads' prompts, where memspec.paths looks
        shutil.copytree(CARRY / "data", work / "data", dirs_exist_ok=True)
    nvcc = a.nvcc or find_nvcc()
    t0 = time.perf_counter()
    if cpu:
        python = Path(sys.executable)
        report.put("env", {"ok": True, "python": str(python), "note": "the .venv's own build",
                           "seconds": 0})  # fmt: skip
    else:
        try:
            gpu = report.put("gpu", {"ok": True, **gpu_info(), "nvcc": nvcc})
            python = make_venv(work / "venv")
        except (subprocess.SubprocessError, OSError, StopIteration, ValueError) as e:
            report.put("env", {"ok": False, "error": str(e)[-400:]})
            return 1
        # The carried wheels and the image's packages together import what the steps use.
        code = "import gguf, pydantic_settings, fastapi, torch, transformers, memspec.cli.main"
        imp = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True)
        report.put("env", {"ok": imp.returncode == 0, "python": str(python),
                           "imports": _last_line(imp.stderr) if imp.returncode else "ok",
                           "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
    libs = locate_cuda_libs(nvcc, python, work) if nvcc else None
    # The llama steps find the toolkit's cudart and the cuBLAS linked against on this path;
    # the torch step keeps PyTorch's own (it loads them from its wheels).
    torch_env = dict(env)
    if libs is not None and not cpu:
        env["LD_LIBRARY_PATH"] = ":".join([*libs.lib_dirs, os.environ.get("LD_LIBRARY_PATH", "")])
    runner = StepRunner(python, work, cpu, logfile, env)

    # Beside the build: the random models (no llama.cpp needed), then the torch backend on
    # them (no llama.cpp either), while the compiler holds the CPUs and the GPU is idle.
    def beside() -> None:
        written = report.put("models-write", runner.run("models-write", report.left() - 150))
        if not written.get("ok"):
            report.put(
                "torch", {"ok": False, "error": "skipped: the random models were not written"}
            )
        else:
            report.put("torch", runner.run("torch", min(150, report.left() - 60), torch_env))

    side = threading.Thread(target=beside, daemon=True)
    side.start()
    if cpu:
        built = True
        if libs is not None and libs.notes["cublas"].startswith("not found"):
            report.put("cuda_configure", {"ok": False, "skipped": True, "cuda_libs": libs.notes,
                       "error": "no cuBLAS here: set GPU_CHECK_CUBLAS to the nvidia/cu13 folder "
                       "of an nvidia-cublas wheel to configure"})  # fmt: skip
        elif libs is not None:
            clog = out_dir / "cuda_configure.log"
            try:
                res = cuda_configure(work, libs, min(300.0, report.left() - 300), clog)
                report.put("cuda_configure", {"ok": True, **res})
            except (subprocess.SubprocessError, OSError) as e:
                report.put("cuda_configure", {"ok": False, "error": str(e)[-400:],
                                              "log_tail": _tail(clog, 8)})  # fmt: skip
        else:
            report.put("cuda_configure", {"ok": False, "error": "no nvcc here"})
    else:
        assert libs is not None  # gpu_check.sh found nvcc
        built = build_step(report, python, work, gpu["cuda_arch"], libs, out_dir)
    side.join(max(report.left() - RESERVE_S, 1))
    steps = report.data["steps"]
    for name, cap in PLAN:
        if name in NEEDS_QUANTIZED:  # timings and equality with the GPU to themselves
            side.join(max(report.left() - FLOOR_S, 0))
        left = report.left()
        why = ""
        if not built:
            why = "no llama.cpp build"
        elif name != "library" and not steps.get("models-write", {}).get("ok"):
            why = "the random models were not written"
        elif name in NEEDS_QUANTIZED and not steps.get("models-quantize", {}).get("ok"):
            why = "the models were not quantized"
        elif left < FLOOR_S:
            why = f"{left:.0f} s left of the budget"
        # The CPU proof's 2 shared cores take longer for the same (shortened) work.
        cap *= 2 if cpu else 1
        report.put(
            name,
            {"ok": False, "error": f"skipped: {why}"} if why else runner.run(name, min(cap, left)),
        )
    side.join(max(report.left(), 1))
    if (work / "runtime_bench.json").is_file():
        shutil.copy(work / "runtime_bench.json", out_dir / "runtime_bench.json")
    report.data["finished"] = time.strftime("%F %T %Z")
    report.data["seconds"] = round(time.perf_counter() - t0, 1)
    report.data["summary"] = summarize(steps)
    with _WRITING:
        report.save()
    log(f"wrote {report.path}")
    print(json.dumps(report.data["summary"], indent=1))
    return 1 if report.data["summary"]["failed_steps"] else 0


def build_step(
    report: Report, python: Path, work: Path, arch: str, libs: CudaLibs, out_dir: Path
) -> bool:
    """The CUDA wheel built, installed in the venv, and its build log's end kept in $OUT."""
    args = cuda_cmake_args(arch, libs)
    t0 = time.perf_counter()
    blog = work / "build.log"
    try:
        whl = build_cuda_wheel(python, work, args, blog, report.left() - RESERVE_S)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--no-index", "--no-deps", "--force-reinstall", str(whl)], check=True)
        report.put("build", {"ok": True, "cmake_args": args, "cuda_libs": libs.notes,
                             "wheel": whl.name,
                             "wheel_bytes": whl.stat().st_size,
                             "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        return True
    except (subprocess.SubprocessError, OSError, StopIteration) as e:
        report.put("build", {"ok": False, "cmake_args": args, "cuda_libs": libs.notes,
                             "error": str(e)[-400:],
                             "log_tail": _tail(blog, 15),
                             "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        return False
    finally:
        with contextlib.suppress(OSError):
            lines = blog.read_text(errors="replace").splitlines()[-3000:]
            (out_dir / "build_tail.log").write_text("\n".join(lines) + "\n")


def summarize(steps: dict[str, Any]) -> dict[str, Any]:
    """The closing note's figures, where measured."""
    s: dict[str, Any] = {
        "failed_steps": [n for n, r in steps.items() if not r.get("ok") and not r.get("skipped")],
        "skipped_steps": [n for n, r in steps.items() if r.get("skipped")],
    }
    v = steps.get("verify", {})
    if v.get("ok"):
        s["verify_ms_1.5b"] = v[QWEN_TARGET]["verify_ms"]
        s["rows5_over_rows1_1.5b"] = v[QWEN_TARGET]["rows5_over_rows1"]
        s["sibling_draft_ms_per_token"] = v[QWEN_DRAFT]["draft_ms_per_token"]
        s["sibling_draft_share_of_target_step"] = v["sibling_draft_share_of_target_step"]
    for name in ("lossless", "torch"):
        r = steps.get(name, {})
        if r.get("ok"):
            s[f"{name}_identical"] = f"{r['identical']}/{r['runs']}"
            s[f"{name}_divergence_margins"] = [d.get("margin") for d in r["divergences"]]
    r = steps.get("runtime", {})
    if r.get("ok"):
        s["runtime_own_ms_per_token"] = r["own_ms_per_token"]
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="gather gpu_carry/ here (sdist, wheels, tokenizers)")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python sdist (default: found or pip)")
    p.add_argument("--models", type=Path, help="models dir holding the real GGUFs")
    r = sub.add_parser("run", help="the check (device), or with --cpu the CPU proof")
    r.add_argument("--cpu", action="store_true", help="CPU proof: no build, the .venv's llama")
    r.add_argument("--out", help="JSON folder (default $OUT, else out/gpu_check)")
    r.add_argument("--work", default=str(DEFAULT_WORK), help="scratch folder (models: GBs)")
    r.add_argument(
        "--budget", type=float, help="seconds for the whole run (default: 560 device, 900 --cpu)"
    )
    r.add_argument("--nvcc", help="nvcc to build with (default: PATH, $CUDA_HOME)")
    s = sub.add_parser("step", help=argparse.SUPPRESS)
    s.add_argument("name", choices=sorted(STEPS))
    s.add_argument("--work", required=True)
    s.add_argument("--result", required=True)
    s.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    if a.cmd == "prepare":
        return prepare(a.sdist, a.models)
    if a.cmd == "step":
        return run_step(a.name, Path(a.work), a.cpu, Path(a.result))
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
