#!/usr/bin/env bash
# Set up if needed (with the torch extra, so both backends are tested, and the second model
# family), then the whole suite.
# Extra arguments go to pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
# The other model families are on: Gemma 3 270M and the real pair (Qwen2.5-Coder 1.5B with its
# 0.5B sibling); their lossless and end-to-end tests need them.
MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-torch,test} MEMSPEC_FAMILIES=${MEMSPEC_FAMILIES-gemma3,qwen2.5-coder} \
  bash scripts/setup.sh
.venv/bin/ruff check memspec tests
# JetPack 6 (the device) has Python 3.10: nothing newer in the code (memspec/compat.py has the
# backports). --eval-annotations: names used only in annotations count too (`X | Y` is
# 3.10 already).
.venv/bin/vermin -q -t=3.10- --violations --no-tips --eval-annotations memspec tests scripts
# The slowest tests are listed at the end: the suite must stay well inside CI's 90 minutes.
exec .venv/bin/python -m pytest -q -ra --durations=30 "$@"
