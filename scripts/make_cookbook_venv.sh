#!/usr/bin/env bash
# Create (or refresh) .venv-cookbook: a separate virtual environment holding
# tinker-cookbook 0.5.8, used only as a *client* by tests/test_cookbook.py.
#
# Why a separate venv: tinker-cookbook 0.5.8 pins transformers<=5.5.4, while the
# project itself needs transformers>=5.24 (see shared/reference/environment-notes.md).
# 0.5.8 is the newest cookbook that installs here (0.6.x needs tml-renderers>=0.4.1).
#
# Idempotent and quiet: a stamp file records the pinned versions; when it matches,
# the script exits at once. Usage:  bash scripts/make_cookbook_venv.sh [VENV_DIR]
# Env: PYTHON (interpreter used to create the venv, default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-cookbook}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"          # the CPU wheel on disk; a bare `torch` pulls a multi-GB CUDA build
COOKBOOK_VERSION="0.5.8"
TINKER_VERSION="0.38.0"
WANT="torch==$TORCH_VERSION tinker-cookbook==$COOKBOOK_VERSION tinker==$TINKER_VERSION v1"
STAMP="$VENV/.cookbook-installed"

up_to_date() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; }
up_to_date && exit 0

log() { echo "make_cookbook_venv: $*" >&2; }

# One builder at a time (e.g. parallel test workers); the second one then finds the stamp.
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.cookbook-lock"
    flock 9
    up_to_date && exit 0
fi

# pip's chatter (including the index warnings of this machine's pip.conf) goes to a log
# that is shown only when a step fails.
PIPLOG="$(mktemp)"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$PIPLOG" "$CONSTRAINTS"' EXIT
run_quiet() {
    if ! "$@" >>"$PIPLOG" 2>&1; then
        log "FAILED: $*"
        tail -n 40 "$PIPLOG" >&2
        exit 1
    fi
}

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV (first time: about 2 minutes, 1.6 GB)"
    run_quiet "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

rm -f "$STAMP"
log "installing torch==$TORCH_VERSION (CPU)"
run_quiet "${PIP[@]}" install -q "torch==$TORCH_VERSION"
log "installing tinker-cookbook==$COOKBOOK_VERSION tinker==$TINKER_VERSION"
# Keep torch where it is: the constraint stops the resolver from swapping it for a CUDA build.
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
run_quiet "${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "tinker-cookbook==$COOKBOOK_VERSION" "tinker==$TINKER_VERSION"

# Sanity check: the pins held and the modules the SFT script uses import.
"$VENV/bin/python" - "$TORCH_VERSION" "$TINKER_VERSION" <<'EOF'
import sys
from importlib.metadata import version
torch_want, tinker_want = sys.argv[1], sys.argv[2]
got = version("torch")
assert got.split("+")[0] == torch_want, f"torch {got} != {torch_want}"
assert version("tinker") == tinker_want, f"tinker {version('tinker')} != {tinker_want}"
import tinker_cookbook.supervised.train  # noqa: F401
import tinker_cookbook.supervised.data  # noqa: F401
EOF

echo "$WANT" >"$STAMP"
log "ready: $VENV"
