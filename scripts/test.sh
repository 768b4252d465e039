#!/usr/bin/env bash
# Set up if needed (with the torch extra, so both backends are tested), then the whole suite.
# Extra arguments go to pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-torch,test} bash scripts/setup.sh
.venv/bin/ruff check memspec tests
exec .venv/bin/python -m pytest -q -ra "$@"
