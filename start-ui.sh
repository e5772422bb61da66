#!/usr/bin/env bash
# Opens the trainer's window: `./run-cmd.sh train_ui` (installs .venv on first use, runs in your current directory
# so relative paths in configs mean what they mean in your shell). Without a display it says so and exits 2.
set -euo pipefail
self="${BASH_SOURCE[0]}"
while [ -L "$self" ]; do
    target="$(readlink "$self")"
    case "$target" in /*) self="$target" ;; *) self="$(dirname "$self")/$target" ;; esac
done
exec "$(cd "$(dirname "$self")" && pwd)/run-cmd.sh" train_ui "$@"
