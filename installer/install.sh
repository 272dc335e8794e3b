#!/usr/bin/env bash
# localserve installer for Linux and macOS: an isolated environment under the user's data
# directory, the llama.cpp build that fits this machine (`localserve setup`), `localserve` on PATH
# (~/.local/bin), the daemon as a user service and the tray at login. Rerunning it upgrades in
# place; every step is safe to repeat, so an interrupted install completes when run again.
#
#   bash installer/install.sh [--from WHEEL|SDIST|DIR] [--find-links DIR] [--port N] [--build B]
#                             [--no-service] [--no-tray] [--no-run]
#   bash installer/install.sh --uninstall   # what localserve made, but downloaded models
#   bash installer/install.sh --purge       # models too (never a file localserve did not write)
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # default: the checkout this script is in
FIND_LINKS=() PORT="" BUILD=auto SERVICE=1 TRAY=1 RUN=1 MODE=install
while [ $# -gt 0 ]; do
    case "$1" in
        --from) SRC="$2"; shift ;;
        --find-links) FIND_LINKS+=(--find-links "$2"); shift ;;
        --port) PORT="$2"; shift ;;
        --build) BUILD="$2"; shift ;;
        --no-service) SERVICE=0 ;;
        --no-tray) TRAY=0 ;;
        --no-run) RUN=0 ;;
        --uninstall) MODE=uninstall ;;
        --purge) MODE=purge ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$PORT" in ""|[0-9]|[0-9][0-9]|[0-9][0-9][0-9]|[0-9][0-9][0-9][0-9]|[0-9][0-9][0-9][0-9][0-9]) ;;
    *) echo "install.sh: --port takes a number" >&2; exit 2 ;; esac

# The same directories platformdirs gives localserve itself.
if [ "$(uname -s)" = Darwin ]; then
    DATA="$HOME/Library/Application Support/localserve"
    CONFIG="$HOME/Library/Application Support/localserve"
    LOGS="$HOME/Library/Logs/localserve"
    CACHE="$HOME/Library/Caches/localserve"
else
    DATA="${XDG_DATA_HOME:-$HOME/.local/share}/localserve"
    CONFIG="${XDG_CONFIG_HOME:-$HOME/.config}/localserve"
    LOGS="${XDG_STATE_HOME:-$HOME/.local/state}/localserve"
    CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/localserve"
fi
MODELS_HOME="${LOCALSERVE_HOME:-$DATA}"  # where the models live (LOCALSERVE_HOME moves them)
VENV="$DATA/venv"
LINK="$HOME/.local/bin/localserve"
LS="$VENV/bin/localserve"

say() { printf '==> %s\n' "$*"; }

# Only what localserve writes in a data home, never an unknown entry: LOCALSERVE_HOME may be a
# folder the user keeps other things in (even $HOME). The names are localserve's own: config.py
# (models/, run/, logs/ under a LOCALSERVE_HOME), daemon.py (run/daemon.lock, run/daemon.json,
# logs/localserve.log and its rotations, logs/daemon-stderr.log), daemon_crash.py
# (logs/daemon-crash.log), engine/worker/ (logs/engine-*.log, each engine worker's stderr), backends/llamacpp/probe.py (run/native-probe.json from releases before its verdicts moved to $CACHE), store.py's atomic
# writes (run/.NAME.PID.tmp), service.py (logs/daemon.log, launchd's), commands/setup.py
# (logs/setup-*.log), batches/ (batches.sqlite3 and its WAL files, files/file-*, files/.tmp/*.part)
# and store.py (models/.locks/*.lock, models/.tmp; with --purge each models/NAME/TAG folder that
# holds a manifest.json or only a pull's partial files). A folder is removed only once empty.
remove_ours() {
    local home="$1" tag entry
    [ -d "$home" ] || return 0
    rm -f "$home/run/daemon.lock" "$home/run/daemon.json" "$home/run/native-probe.json" \
          "$home/run"/.daemon.json.*.tmp "$home/run"/.native-probe.json.*.tmp
    rm -f "$home/logs/localserve.log" "$home/logs/localserve.log".[0-9] "$home/logs/daemon-stderr.log" \
          "$home/logs/daemon-crash.log" "$home/logs/daemon.log" "$home/logs"/setup-*.log "$home/logs"/engine-*.log
    rm -f "$home/batches/batches.sqlite3" "$home/batches/batches.sqlite3-wal" "$home/batches/batches.sqlite3-shm" \
          "$home/batches/files"/file-* "$home/batches/files/.tmp"/*.part
    rm -f "$home/models/.locks"/*.lock
    # store/prompt_cache.py: prompt-cache/<model sha256>/*.kv and writes cut short (.*.tmp); they hold prompts.
    rm -f "$home/prompt-cache"/*/*.kv "$home/prompt-cache"/*/.*.tmp
    for entry in "$home/prompt-cache"/*/; do rmdir "$entry" 2>/dev/null || true; done
    rm -rf "$home/models/.tmp"
    [ "$home" = "$DATA" ] && [ "$CONFIG" = "$DATA" ] && rm -f "$home/config.toml"  # macOS: one folder
    if [ "$MODE" = purge ]; then
        for tag in "$home/models"/*/*/; do
            # A link in the path leads out of our store: whatever it reaches is not ours to remove.
            [ -d "$tag" ] && [ ! -L "${tag%/}" ] && [ ! -L "$(dirname "${tag%/}")" ] || continue
            if [ -f "$tag/manifest.json" ] || only_partials "$tag"; then rm -rf "$tag"; fi
        done
        for entry in "$home/models"/*/; do rmdir "$entry" 2>/dev/null || true; done
    fi
    for entry in batches/files/.tmp batches/files batches logs run models/.locks models prompt-cache; do
        rmdir "$home/$entry" 2>/dev/null || true
    done
    # The data home itself once empty, unless it is the user's home directory (LOCALSERVE_HOME=$HOME).
    [ "$(cd "$home" && pwd -P)" = "$(cd "$HOME" && pwd -P)" ] || rmdir "$home" 2>/dev/null || true
}

# A tag folder an interrupted pull left: nothing in it but `*.partial`, `*.partial.json` and `folder.partial/`.
only_partials() {
    local entry
    for entry in "$1"/* "$1"/.[!.]*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        case "$(basename "$entry")" in *.partial|*.partial.json) ;; *) return 1 ;; esac
    done
}

# Say what stayed in a data home, so nothing is left there unseen.
report_left() {
    local home="$1" entry names=""
    [ -d "$home" ] || return 0
    for entry in "$home"/* "$home"/.[!.]*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        names="$names ${entry##*/}"
    done
    [ -n "$names" ] && say "left in $home (not removed):$names"
    return 0
}

if [ "$MODE" != install ]; then
    if [ -x "$LS" ]; then
        "$LS" service uninstall >/dev/null 2>&1 || true
        "$LS" autostart off >/dev/null 2>&1 || true
        "$LS" stop >/dev/null 2>&1 || true
    fi
    [ -L "$LINK" ] && [ "$(readlink "$LINK")" = "$LS" ] && rm -f "$LINK"
    rm -rf "$VENV" "$LOGS" "$CACHE"
    remove_ours "$MODELS_HOME"
    [ "$MODELS_HOME" != "$DATA" ] && remove_ours "$DATA"
    [ "$CONFIG" != "$DATA" ] && rm -rf "$CONFIG"
    if [ "$MODE" = uninstall ] && [ -d "$MODELS_HOME/models" ]; then
        say "localserve removed; downloaded models kept in $MODELS_HOME/models (--purge removes them)"
    else
        say "localserve removed"
    fi
    report_left "$MODELS_HOME"
    [ "$MODELS_HOME" != "$DATA" ] && report_left "$DATA"
    exit 0
fi

# Python first, before anything is written.
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "localserve needs Python 3.10 or newer, and '$PY' was not found. Install Python 3.10+" \
         "(your package manager's python3, or python.org) and run this again; PYTHON=/path/to/python3 picks one." >&2
    exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
    found="$("$PY" --version 2>&1 | head -1 || true)"
    echo "localserve needs Python 3.10 or newer; '$PY' is ${found:-not a working Python}." \
         "Install Python 3.10+ and run this again (PYTHON=/path/to/python3 picks one). Nothing was changed." >&2
    exit 1
fi
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "'$PY' cannot create virtual environments (Debian/Ubuntu: apt install python3-venv). Nothing was changed." >&2
    exit 1
fi

say "environment: $VENV"
mkdir -p "$DATA"
# A venv left half-made by an interrupted run has no working pip: make it again.
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi

# If pip has to compile llama.cpp here, leave AMX out where cpuid claims it: some x86-64 VMs
# advertise AMX and trap its instructions (SIGILL); localserve/buildinfo.py explains. The same
# guard applies to `localserve setup` below, which decides it from the hardware report.
if [ "$(uname -m)" = x86_64 ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    export CFLAGS="${CFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CXXFLAGS="${CXXFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
say "installing localserve from $SRC"
# Dependencies first (an installed llama-cpp-python of the pinned version is kept, whatever its
# build), then localserve itself again, so a rebuilt wheel of the same version replaces the old.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check ${FIND_LINKS[@]+"${FIND_LINKS[@]}"} "$SRC"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$SRC"

say "llama.cpp build"
"$LS" setup --build "$BUILD"

mkdir -p "$(dirname "$LINK")"
ln -sfn "$LS" "$LINK"
case ":$PATH:" in *":$HOME/.local/bin:"*) ;; *) say "add ~/.local/bin to PATH to run localserve from anywhere" ;; esac

if [ -n "$PORT" ]; then
    mkdir -p "$CONFIG"
    # Clients started later (run, tray) find the daemon on the same port through the config.
    if [ -f "$CONFIG/config.toml" ] && grep -q '^port *=' "$CONFIG/config.toml"; then
        sed -i.bak "s/^port *=.*/port = $PORT/" "$CONFIG/config.toml" && rm -f "$CONFIG/config.toml.bak"
    else
        echo "port = $PORT" >> "$CONFIG/config.toml"
    fi
fi
if [ "$SERVICE" = 1 ]; then
    say "user service"
    "$LS" service install
fi
if [ "$TRAY" = 1 ]; then
    say "tray at login"
    "$LS" autostart on
fi
if [ "$RUN" = 1 ]; then
    say "first answer (pulls the default model if needed)"
    "$LS" run smollm2-135m "Say hi"
fi
say "done: $("$LS" --version)"
