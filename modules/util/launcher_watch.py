"""A rank dies with its launcher (docs/multi-gpu.md, "Failures").

torchrun's agent (and `multi_gpu`'s launcher, the same agent inside train.py) starts every rank in a session of its
own, so a launcher killed with SIGKILL (or by the OOM killer) takes no rank with it: the orphans would go on
training, writing backups and the output while a rerun of the command resumes beside them. Two guards, each
covering what the other cannot:

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the rank the moment its
  launcher exits, even while the rank waits in a collective or a long C call. SIGKILL and not SIGTERM: a rank has
  nothing to save (every write is atomic and the last backup stays as it was), and a Python handler another library
  installed for SIGTERM runs only between bytecodes, too late for a rank stuck in a collective. It does not cover a
  launcher that died before the call (the signal is armed for the parent the rank has then), and it fires when the
  parent *thread* that started the rank ends (torch's agent starts ranks from its main thread, which lives as long
  as the agent).
- A watchdog thread (every platform with a parent pid): once a second it compares os.getppid() with the launcher's
  pid; an orphan is re-parented (to init or a subreaper), so the pid changes. It also catches the launcher that died
  before the guards were set: `multi_gpu`'s launcher records its pid in WAN_TRAINER_LAUNCHER_PID for its ranks.
  Under a bare torchrun the launcher is the parent the rank has when the guard starts (its first lines)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

ENVIRONMENT_VARIABLE = "WAN_TRAINER_LAUNCHER_PID"
INTERVAL_S = 1.0

_watched: int | None = None


def launcher_pid() -> int:
    """The launcher this rank must not outlive: the one that recorded itself, else the parent now."""
    recorded = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return int(recorded) if recorded.isdigit() else os.getppid()


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _stop(launcher: int) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"train: rank {rank}: its launcher (process {launcher}) is gone; stopping (the last backup is kept)",
          file=sys.stderr, flush=True)
    os._exit(1)   # at once, from any thread: nothing is left to report to, and every write is atomic


def _watch(launcher: int) -> None:
    while True:
        if os.getppid() != launcher:
            _stop(launcher)
        time.sleep(INTERVAL_S)


def die_with_launcher() -> None:
    """Arms both guards for this rank (once a process; later calls do nothing)."""
    global _watched
    if _watched is not None:
        return
    _watched = launcher_pid()
    _set_parent_death_signal()
    if os.getppid() != _watched:   # it died before the signal was armed
        _stop(_watched)
    threading.Thread(target=_watch, args=(_watched,), name="launcher-watch", daemon=True).start()


def die_with_launcher_if_rank() -> None:
    """die_with_launcher() for a rank of a torchrun job (WORLD_SIZE > 1), before torch.distributed is imported."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        die_with_launcher()
