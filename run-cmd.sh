#!/usr/bin/env bash
# Usage: ./run-cmd.sh SCRIPT [ARGS...]  runs scripts/SCRIPT.py inside .venv (installing it first if needed).
set -euo pipefail
cd "$(dirname "$0")"
if [ $# -lt 1 ]; then
    echo "usage: ./run-cmd.sh SCRIPT [ARGS...]; scripts: $(cd scripts && ls [a-z]*.py | sed 's/\.py$//' | tr '\n' ' ')" >&2
    exit 2
fi
script="scripts/$1.py"; shift
[ -f "$script" ] || { echo "run-cmd.sh: no such script: $script" >&2; exit 2; }
./install.sh
exec .venv/bin/python "$script" "$@"
