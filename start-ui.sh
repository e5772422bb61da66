#!/usr/bin/env bash
# Opens the trainer's window: installs .venv on first use (install.sh), then runs scripts/train_ui.py.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
exec .venv/bin/python scripts/train_ui.py "$@"
