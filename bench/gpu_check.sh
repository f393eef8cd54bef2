#!/usr/bin/env bash
# The engine on one GPU from a bare image (torch, transformers; no weights): see bench/gpu_check.py.
#   bash bench/gpu_check.sh           # on a GPU, a few minutes (the budget is 8)
#   bash bench/gpu_check.sh --smoke   # a tiny model on CPU, to check the script itself
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec timeout 480 env PYTHONPATH=. "$PYTHON" bench/gpu_check.py "$@"
