#!/usr/bin/env bash
# Issue 40's device check: llama-cpp-python built with CUDA for the card found, then the verify
# curve and draft costs of Qwen2.5-1.5B/0.5B-shaped random models, the engine's lossless checks,
# `memspec bench runtime` and the torch backend, all on the GPU; JSON to $OUT (scripts/gpu_check.py
# says what each step does; docs/scheduling.md how to run it on a lent device).
#
#   scripts/gpu_check.sh --prepare   here: gather gpu_carry/ (trimmed sdist, wheels, tokenizers)
#   scripts/gpu_check.sh             on the device (nvidia-smi and nvcc there): the check
#   scripts/gpu_check.sh --cpu       the CPU proof: the same steps on the .venv's llama build,
#                                    a CUDA configure of the carried source, short runs
# Further flags go to `scripts/gpu_check.py run` (--out DIR, --work DIR, --budget S).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV_PY="$ROOT/.venv/bin/python"
fail() { echo "gpu_check: $*" >&2; exit 2; }

case "${1:-}" in
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --prepare|--cpu)
    [ -x "$VENV_PY" ] || fail "no .venv: run scripts/setup.sh first"
    if [ "$1" = --prepare ]; then
      shift; exec "$VENV_PY" "$ROOT/scripts/gpu_check.py" prepare "$@"
    fi
    shift; exec "$VENV_PY" "$ROOT/scripts/gpu_check.py" run --cpu "$@" ;;
esac

# The device run: fail at once, in one line, where there is no GPU or no CUDA toolkit.
command -v nvidia-smi >/dev/null 2>&1 ||
  fail "no GPU found (no nvidia-smi): run this on a lent GPU machine; scripts/gpu_check.sh --cpu is the CPU proof"
gpus=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | grep -v '^ *$')
[ -n "$gpus" ] ||
  fail "no GPU found (nvidia-smi lists none): run this on a lent GPU machine; scripts/gpu_check.sh --cpu is the CPU proof"
nvcc=$(command -v nvcc 2>/dev/null || true)
[ -n "$nvcc" ] || { [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"; }
[ -n "$nvcc" ] || fail "no CUDA toolkit (no nvcc on PATH or in ${CUDA_HOME:-/usr/local/cuda}/bin): cannot build llama.cpp for CUDA"
[ -f "${GPU_CHECK_CARRY:-$ROOT/gpu_carry}/manifest.json" ] ||
  fail "gpu_carry/ missing: run scripts/gpu_check.sh --prepare here first, then carry gpu_carry"
echo "gpu_check: $(echo "$gpus" | head -1), nvcc $nvcc" >&2
# The image's python3 holds PyTorch; the script makes a venv over it for the rest.
exec "${GPU_CHECK_PYTHON:-python3}" "$ROOT/scripts/gpu_check.py" run --nvcc "$nvcc" "$@"
