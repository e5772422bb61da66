#!/usr/bin/env bash
# Usage: ./run-cmd.sh SCRIPT [ARGS...]  runs scripts/SCRIPT.py inside .venv (installing it first if needed).
# The script runs in the directory you ran this from, so relative paths in ARGS (and in your config files) mean
# what they mean in your shell; install.sh changes into the project folder in its own process only.
set -euo pipefail
self="${BASH_SOURCE[0]}"
while [ -L "$self" ]; do  # called through a link (e.g. ~/bin/wan-train): the project is where the link points
    target="$(readlink "$self")"
    case "$target" in /*) self="$target" ;; *) self="$(dirname "$self")/$target" ;; esac
done
root="$(cd "$(dirname "$self")" && pwd)"
if [ $# -lt 1 ]; then
    echo "usage: $0 SCRIPT [ARGS...]; scripts: $(cd "$root/scripts" && ls [a-z]*.py | sed 's/\.py$//' | tr '\n' ' ')" >&2
    exit 2
fi
name="$1"; shift
# `queue` is scripts/job_queue.py: a script named queue.py would shadow Python's queue module for every script
case "$name" in queue) name=job_queue ;; esac
script="$root/scripts/$name.py"
[ -f "$script" ] || { echo "run-cmd.sh: no such script: $script" >&2; exit 2; }
"$root/install.sh"
exec "$root/.venv/bin/python" "$script" "$@"
