#!/usr/bin/env bash
# Set up if needed, then the test suite, in tiers:
#   scripts/test.sh          what CI runs: every lossless and end-to-end check on the real
#                            models (SmolLM2, Gemma 3 270M, the Qwen2.5-Coder pair): greedy for
#                            every draft kind, sampling once per draft kind, batching, the HTTP
#                            surface, the Ollama and OpenAI clients; the slow tier (soak,
#                            trainings, walkthrough, kill-restart loops, benchmark runs, and
#                            checks the default tier makes repeated on another family, KV cache
#                            type or exactness mode) is left out
#   scripts/test.sh --quick  no models: the logic over stub backends, the configuration and the
#                            HTTP surface's parsing (set-up installs no model)
#   scripts/test.sh --all    both tiers: the default one and `-m slow`
# Other arguments go to pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=default
args=()
for a in "$@"; do
  case "$a" in
    --quick) tier=quick ;;
    --all) tier=all ;;
    *) args+=("$a") ;;
  esac
done
if [ "$tier" = quick ]; then
  MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-test} MEMSPEC_NO_MODELS=1 bash scripts/setup.sh
  export MEMSPEC_TEST_TIER=quick
else
  # The other model families are on: Gemma 3 270M and the real pair (Qwen2.5-Coder 1.5B with
  # its 0.5B sibling); their lossless and end-to-end tests need them.
  MEMSPEC_EXTRAS=${MEMSPEC_EXTRAS-torch,test} \
    MEMSPEC_FAMILIES=${MEMSPEC_FAMILIES-gemma3,qwen2.5-coder} bash scripts/setup.sh
fi
.venv/bin/ruff check memspec lab tests
# JetPack 6 (the device) has Python 3.10: nothing newer in the code (memspec/compat.py has the
# backports). --eval-annotations: names used only in annotations count too (`X | Y` is
# 3.10 already).
.venv/bin/vermin -q -t=3.10- --violations --no-tips --eval-annotations memspec lab tests scripts
select=(-m "not slow")
[ "$tier" = all ] && select=()
# The slowest tests are listed at the end: the default tier must stay inside 30 minutes on a
# fresh machine, set-up included (CI's limit is 90).
exec .venv/bin/python -m pytest -q -ra --durations=30 "${select[@]}" "${args[@]}"
