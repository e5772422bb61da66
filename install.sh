#!/usr/bin/env bash
# Creates .venv and installs the project's dependencies: torch for this platform first, then the rest.
# Platform: WAN_TRAINER_PLATFORM=cuda|rocm|cpu overrides detection. WAN_TRAINER_DEV=1 adds the test tools.
set -euo pipefail
cd "$(dirname "$0")"

python_bin="${PYTHON:-python3}"
if ! "$python_bin" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)'; then
    echo "install.sh: $python_bin is $("$python_bin" --version 2>&1); Python 3.10 to 3.13 is required (set PYTHON=...)." >&2
    exit 1
fi

platform="${WAN_TRAINER_PLATFORM:-}"
if [ -z "$platform" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; then platform=cuda
    elif [ -e /dev/kfd ]; then platform=rocm
    else platform=cpu
    fi
fi
case "$platform" in cuda|rocm|cpu) ;; *)
    echo "install.sh: WAN_TRAINER_PLATFORM=$platform; allowed: cuda, rocm, cpu." >&2; exit 1;;
esac

files=("requirements-$platform.txt" requirements-global.txt)
[ "${WAN_TRAINER_DEV:-0}" = 1 ] && files+=(requirements-dev.txt)
stamp=".venv/.installed-$(cat "${files[@]}" | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
echo "install.sh: installing for platform '$platform' into .venv"
.venv/bin/python -m pip install -q --upgrade pip
# torch first, so nothing below pulls a different build of it
.venv/bin/python -m pip install -q -r "requirements-$platform.txt"
for f in "${files[@]:1}"; do .venv/bin/python -m pip install -q -r "$f"; done
touch "$stamp"
