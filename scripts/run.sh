#!/usr/bin/env bash
# Set up if needed, then start the daemon on the testbed models (127.0.0.1:8000 by default).
# Extra arguments go to `memspec serve` (e.g. --port 8080 --config FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-} bash scripts/setup.sh
exec .venv/bin/memspec serve "$@"
