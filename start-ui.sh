#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
exec .venv/bin/python scripts/train_ui.py "$@"
