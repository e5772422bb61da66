"""Runs on the remote, detached from the SSH session (started through setsid and nohup): starts the training
command with its output in `<run>/train.log`, writes the trainer's process id to `<run>/pid` (Stop sends it SIGINT,
as a Ctrl-C does here) and, when it ends, its exit status to `<run>/exit_status`. Only the standard library: it is
the first thing to run in a fresh project copy.

  python -m modules.remote.supervisor RUN_DIR -- COMMAND...
"""
import os
import signal
import subprocess
import sys
from pathlib import Path


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv: list[str]) -> int:
    run_dir, separator, *command = argv
    if separator != "--" or not command:
        print(__doc__, file=sys.stderr)
        return 2
    run = Path(run_dir)
    # a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT: the trainer must see
    # the Ctrl-C that Stop sends
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with open(run / "train.log", "ab", buffering=0) as log:
        try:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as error:
            log.write(f"remote supervisor: cannot start {command[0]}: {error}\n".encode())
            _write(run / "exit_status", "127\n")
            return 127
        _write(run / "pid", f"{child.pid}\n")
        status = child.wait()
    _write(run / "exit_status", f"{status if status >= 0 else 128 - status}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
