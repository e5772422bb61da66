#!/usr/bin/env bash
# Installs the venv with the test tools if needed, then runs pytest; arguments pass through to pytest.
# The GUI tests need an X server (Xvfb), xdotool and ImageMagick's `import`: installed here with apt-get when
# missing and possible (root, or password-less sudo); otherwise those tests skip and say why. The remote-run tests
# need an OpenSSH server (openssh-server; tests/sshd_server.py starts it as the current user on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")"
WAN_TRAINER_DEV=1 ./install.sh
missing=()
command -v Xvfb >/dev/null 2>&1 || missing+=(xvfb)
command -v xdotool >/dev/null 2>&1 || missing+=(xdotool)
command -v import >/dev/null 2>&1 || missing+=(imagemagick)
{ command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || missing+=(openssh-server)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    sudo=()
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
    fi
    if [ "${sudo[*]}" = none ]; then
        echo "run-tests.sh: ${missing[*]} missing and apt-get needs root: the tests that need them will skip" >&2
    else
        echo "run-tests.sh: installing ${missing[*]} for the GUI and remote-run tests (apt-get)" >&2
        { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
            "${missing[@]}" >/dev/null; } || echo "run-tests.sh: apt-get failed: the tests that need ${missing[*]} will skip" >&2
    fi
fi
# Tests run in parallel worker processes (pytest-xdist), one more than the cores up to 4, each file's tests on one
# worker so module fixtures are built once, the longest files first (tests/slow_files.txt; tests/conftest.py orders
# them and --no-loadscope-reorder keeps that order); each test process keeps torch to one thread (tests/conftest.py).
# --durations=20 lists the slowest tests at the end, to keep that list current.
# WAN_TEST_WORKERS=0 runs them in this process; a -n in the arguments wins.
# A sixth of a worker's time is spent waiting (child processes starting, sockets, the GUI's event loop), so a worker
# beyond the cores keeps them busy: on 2 cores the suite took 24.9 to 25.9 min with 3 workers (three runs), 27.1
# with 2, 24.9 with 4 (no faster, and a test's timing race showed).
workers="${WAN_TEST_WORKERS:-$(( $(nproc 2>/dev/null || echo 2) + 1 ))}"
[ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=20 "$@"
