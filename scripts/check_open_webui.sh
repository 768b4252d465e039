#!/usr/bin/env bash
# Open WebUI against memspec's Ollama API, in a real (headless) browser. Issue 37.
#
#   scripts/check_open_webui.sh [--memspec-url URL] [--out DIR] [--summary FILE] [--keep-logs]
#                               [--builtin-tools on|off] [--answer-timeout SECONDS]
#
# Sets up Open WebUI and Playwright in their own venv outside the checkout (never .venv),
# installs Debian's chromium if it is missing, starts memspec on a free port (or uses the
# daemon at --memspec-url / $MEMSPEC_CHECK_URL), starts Open WebUI on another free port with
# its one Ollama connection pointed at memspec, and runs scripts/check_open_webui.py:
# model list, model details, a streamed chat answer. Screenshots go to DIR (docs/img/), the
# JSON summary to stdout (and FILE). Everything started here is stopped on exit.
# --builtin-tools off sets Open WebUI's model default "Builtin Tools" off (DEFAULT_MODEL_METADATA):
# by default (on, as Open WebUI ships) every chat carries 36 tool specs, a ~7k-token prompt.
# Too heavy for CI (a 3 GB venv, a browser); see docs/open-webui-check.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OWUI_VERSION="${OWUI_VERSION:-0.12.4}"
PLAYWRIGHT_VERSION="${PLAYWRIGHT_VERSION:-1.60.0}"   # the pin of open-webui[all]
VENV="${OWUI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/memspec/open-webui-venv}"
MEMSPEC_URL_GIVEN="${MEMSPEC_CHECK_URL:-}"
OUT_DIR="$ROOT/docs/img"
SUMMARY=""
KEEP_LOGS=0
# Open WebUI 0.12's built-in tool specs alone render to ~7k tokens: 2048 would refuse every chat.
N_CTX="${CHECK_N_CTX:-8192}"
BUILTIN_TOOLS=on
ANSWER_TIMEOUT=900

die() { echo "check_open_webui: $*" >&2; exit 1; }
say() { echo "[check_open_webui] $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --memspec-url) MEMSPEC_URL_GIVEN="${2:?--memspec-url needs a URL}"; shift 2 ;;
        --out) OUT_DIR="$(realpath -m "${2:?--out needs a directory}")"; shift 2 ;;
        --summary) SUMMARY="$(realpath -m "${2:?--summary needs a file}")"; shift 2 ;;
        --keep-logs) KEEP_LOGS=1; shift ;;
        --builtin-tools) BUILTIN_TOOLS="${2:?--builtin-tools needs on or off}"; shift 2 ;;
        --answer-timeout) ANSWER_TIMEOUT="${2:?--answer-timeout needs seconds}"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

case "$BUILTIN_TOOLS" in
    on) MODEL_METADATA='{}'; SHOT_SUFFIX="" ;;
    off) MODEL_METADATA='{"capabilities": {"builtin_tools": false}}'; SHOT_SUFFIX="-no-tools" ;;
    *) die "--builtin-tools takes on or off, not $BUILTIN_TOOLS" ;;
esac

# --- processes we start, stopped on any exit -------------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/memspec-owui-check.XXXXXX")"
PIDS=()
STATUS=1
cleanup() {
    local pid i
    for pid in "${PIDS[@]}"; do
        # Each server runs in its own session (setsid): signal its whole group, nothing else.
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        for i in $(seq 1 60); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    if [ "$STATUS" -eq 0 ] && [ "$KEEP_LOGS" -eq 0 ]; then
        rm -rf "$WORK"
    else
        say "logs kept in $WORK (memspec.log, open-webui.log)"
    fi
}
trap 'STATUS=$?; cleanup' EXIT
trap 'exit 130' INT TERM

start_bg() {  # start_bg LOG CMD...: own session, so cleanup can stop its children too
    local log="$1"; shift
    setsid "$@" >"$log" 2>&1 < /dev/null &
    PIDS+=("$!")
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_http() {  # wait_http URL SECONDS PID NAME LOG: until 200, or the process died, or time out
    local url="$1" secs="$2" pid="$3" name="$4" log="$5" t=0
    while [ "$t" -lt "$secs" ]; do
        if [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || true)" = 200 ]; then
            say "$name ready after ${t}s"
            return 0
        fi
        if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$log" >&2 || true
            die "$name exited before it was ready (log above)"
        fi
        sleep 2; t=$((t + 2))
    done
    tail -n 30 "$log" >&2 || true
    die "$name not ready at $url after ${secs}s"
}

# --- Open WebUI + Playwright venv ------------------------------------------------------------
STAMP="$VENV/.memspec-check"
WANT_STAMP="open-webui==$OWUI_VERSION playwright==$PLAYWRIGHT_VERSION"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT_STAMP" ]; then
    PY=""
    for cand in python3.11 python3.12; do  # open-webui wants >=3.11,<3.13
        if command -v "$cand" >/dev/null && "$cand" -c 'import venv' 2>/dev/null; then PY="$cand"; break; fi
    done
    [ -n "$PY" ] || die "Open WebUI $OWUI_VERSION needs python3.11 or python3.12 with venv"
    say "installing Open WebUI $OWUI_VERSION and Playwright $PLAYWRIGHT_VERSION into $VENV (about 3 GB, once)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # sentence-transformers pulls torch; the CUDA build would add GBs of libraries nobody uses
    # here, so take a CPU build when the index has one.
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        CPU_TORCH="$("$VENV/bin/pip" index versions torch 2>/dev/null | grep -o '[0-9][0-9.]*+cpu' | head -n 1 || true)"
        if [ -n "$CPU_TORCH" ]; then
            "$VENV/bin/pip" install -q "torch==$CPU_TORCH"
        elif ! "$VENV/bin/pip" install -q --index-url https://download.pytorch.org/whl/cpu torch 2>/dev/null; then
            say "no CPU-only torch wheel reachable: the default torch wheel comes in with Open WebUI"
        fi
    fi
    TORCH_PIN=()
    if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        TORCH_PIN=("torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')")
    fi
    "$VENV/bin/pip" install -q "${OWUI_WHEEL:-open-webui==$OWUI_VERSION}" "playwright==$PLAYWRIGHT_VERSION" "${TORCH_PIN[@]}" \
        || die "pip could not install open-webui==$OWUI_VERSION into $VENV"
    echo "$WANT_STAMP" > "$STAMP"
fi

# --- Chromium (Debian's; Playwright's own download needs the internet) ------------------------
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [ -z "$CHROMIUM" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's chromium"
        apt-get install -y chromium >/dev/null || { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; } \
            || die "apt-get install chromium failed; install it, or set CHROMIUM=/path/to/chromium"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null && command -v apt-get >/dev/null; then
        say "installing Debian's chromium (sudo)"
        sudo -n apt-get install -y chromium >/dev/null || die "sudo apt-get install chromium failed; set CHROMIUM=/path"
    else
        die "no chromium: run 'sudo apt-get install -y chromium' (Debian), or set CHROMIUM=/path/to/chromium"
    fi
    CHROMIUM="$(command -v chromium)" || die "chromium installed but not on PATH"
fi

# --- memspec -----------------------------------------------------------------------------------
MEMSPEC_LOG=""
if [ -n "$MEMSPEC_URL_GIVEN" ]; then
    MEMSPEC_URL="${MEMSPEC_URL_GIVEN%/}"
    wait_http "$MEMSPEC_URL/health" 30 "" memspec /dev/null
else
    [ -x "$ROOT/.venv/bin/memspec" ] || die "no $ROOT/.venv/bin/memspec: run scripts/setup.sh first, or pass --memspec-url"
    MS_PORT="$(free_port)"
    MEMSPEC_URL="http://127.0.0.1:$MS_PORT"
    MEMSPEC_LOG="$WORK/memspec.log"
    say "starting memspec on $MEMSPEC_URL (default target, n_ctx $N_CTX)"
    # A state dir of its own: live-tuned settings of another daemon must not apply here.
    MEMSPEC_LOG_LEVEL=info start_bg "$MEMSPEC_LOG" "$ROOT/.venv/bin/memspec" serve \
        --host 127.0.0.1 --port "$MS_PORT" --n-ctx "$N_CTX" --state-dir "$WORK/memspec-state"
    wait_http "$MEMSPEC_URL/health" 600 "${PIDS[-1]}" memspec "$MEMSPEC_LOG"
fi

# --- Open WebUI --------------------------------------------------------------------------------
UI_PORT="$(free_port)"
UI_URL="http://127.0.0.1:$UI_PORT"
say "starting Open WebUI $OWUI_VERSION on $UI_URL (Ollama connection: $MEMSPEC_URL)"
# Offline, single-user, Ollama only. The embedding engine is set to "ollama" so that start-up
# does not try to load sentence-transformers' model from Hugging Face; nothing here embeds.
# Tags and follow-up suggestions are off (each is one more generation after the answer on
# a 2-core box); title generation stays on: it is Open WebUI's non-streamed /api/chat call.
# ENABLE_PERSISTENT_CONFIG=False: these settings win over anything in the (fresh) database.
start_bg "$WORK/open-webui.log" env \
    DATA_DIR="$WORK/open-webui-data" \
    WEBUI_SECRET_KEY="$(head -c 24 /dev/urandom | base64)" \
    WEBUI_AUTH=False \
    ENABLE_PERSISTENT_CONFIG=False \
    DEFAULT_MODEL_METADATA="$MODEL_METADATA" \
    ENABLE_OLLAMA_API=True \
    OLLAMA_BASE_URL="$MEMSPEC_URL" \
    ENABLE_OPENAI_API=False \
    OFFLINE_MODE=True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    RAG_EMBEDDING_ENGINE=ollama RAG_EMBEDDING_MODEL_AUTO_UPDATE=False RAG_RERANKING_MODEL_AUTO_UPDATE=False \
    ENABLE_VERSION_UPDATE_CHECK=False ENABLE_COMMUNITY_SHARING=False \
    ENABLE_TAGS_GENERATION=False ENABLE_FOLLOW_UP_GENERATION=False ENABLE_AUTOCOMPLETE_GENERATION=False \
    ANONYMIZED_TELEMETRY=False DO_NOT_TRACK=True SCARF_NO_ANALYTICS=True \
    "$VENV/bin/open-webui" serve --host 127.0.0.1 --port "$UI_PORT"
wait_http "$UI_URL/health" 300 "${PIDS[-1]}" "Open WebUI" "$WORK/open-webui.log"

# --- the browser -------------------------------------------------------------------------------
ARGS=(--ui "$UI_URL" --memspec "$MEMSPEC_URL" --chromium "$CHROMIUM" --out "$OUT_DIR"
      --answer-timeout "$ANSWER_TIMEOUT" --label "builtin_tools=$BUILTIN_TOOLS" "--shot-suffix=$SHOT_SUFFIX")
[ -n "$SUMMARY" ] && ARGS+=(--summary "$SUMMARY")
[ -n "$MEMSPEC_LOG" ] && ARGS+=(--memspec-log "$MEMSPEC_LOG")
set +e
"$VENV/bin/python" "$ROOT/scripts/check_open_webui.py" "${ARGS[@]}"
RC=$?
set -e
exit "$RC"
