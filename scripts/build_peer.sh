#!/usr/bin/env bash
# Opt-in (not in CI, ~10 min on 2 cores): build llama.cpp's own `llama-server` from the llama.cpp
# that the pinned llama-cpp-python vendors, with the same flags as the installed library (from
# .venv/.memspec-llama.json: llamafile off, the fallback ISA flags if the native build crashed),
# so `memspec bench engine --peer-server` compares the two on the same kernels.
#   scripts/setup.sh --peer    (or: scripts/build_peer.sh after setup)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
stamp=.venv/.memspec-llama.json
[ -f "$stamp" ] || { echo "[peer] run scripts/setup.sh first" >&2; exit 1; }
version=$($PY -c "import json; print(json.load(open('$stamp'))['version'])")
args=$($PY -c "import json; print(json.load(open('$stamp'))['cmake_args'])")
key=$($PY -c "import json; print(json.load(open('$stamp'))['key'])")
out="${XDG_CACHE_HOME:-$HOME/.cache}/memspec/peer/$key"
if [ -x "$out/llama-server" ]; then
  echo "[peer] $out/llama-server is built"
else
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  echo "[peer] fetching the llama-cpp-python $version sdist"
  $PY -m pip download --quiet --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$version"
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
  vendor=$(ls -d "$src"/llama_cpp_python-*/vendor/llama.cpp)
  echo "[peer] building llama-server with '$args -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON'"
  # shellcheck disable=SC2086  # the flags are a list
  cmake -S "$vendor" -B "$src/build" -DCMAKE_BUILD_TYPE=Release $args \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$src/build" --target llama-server -j "$(nproc)"
  mkdir -p "$out"
  cp "$src/build/bin/llama-server" "$out/llama-server"
fi
mkdir -p data/bin
ln -sf "$out/llama-server" data/bin/llama-server
echo "[peer] data/bin/llama-server -> $out/llama-server"
