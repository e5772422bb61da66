#!/usr/bin/env bash
# Installs the venv with the test tools if needed, then runs pytest; arguments pass through to pytest.
set -euo pipefail
cd "$(dirname "$0")"
WAN_TRAINER_DEV=1 ./install.sh
exec .venv/bin/python -m pytest "$@"
