#!/usr/bin/env bash
# Set up if needed (with the torch extra, so both backends are tested, and the second model
# family), then the whole suite.
# Extra arguments go to pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
# The second model family (Gemma 3 270M) is on: its lossless and end-to-end tests need it.
MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-torch,test} MEMSPEC_FAMILIES=${MEMSPEC_FAMILIES-gemma3} \
  bash scripts/setup.sh
.venv/bin/ruff check memspec tests
exec .venv/bin/python -m pytest -q -ra "$@"
