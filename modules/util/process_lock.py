"""A lock file held by a live process: the queue's runner lock and a training workspace's lock share it.

An exclusive, non-blocking `flock` on the file, whose JSON content names the holder (host, pid, when it took the
lock, its command) for whoever is refused. The kernel drops a flock when its holder dies, however it dies
(SIGKILL, OOM killer), so a lock is never left held by a dead process and a reused pid cannot fake a holder: no pid
or start-time guesswork decides staleness. A holder that ended without releasing (killed) leaves its record in the
file; the next taker gets it back to say so. No lock where fcntl is missing (Windows).

The file is written in place, not atomically: a rename would put a new file (a new inode) at the path, which a
third process could lock while the holder still locks the old one."""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path


class LockHeld(RuntimeError):
    """The lock is held by a live process; `holder` is its record ({} when it could not be read yet)."""

    def __init__(self, path: Path, holder: dict):
        super().__init__(f"{path} is held by {describe_holder(holder)}")
        self.path, self.holder = path, holder


def own_record(**extra) -> dict:
    """This process as a lock's holder: host, pid, the time, the command line."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": shlex.join([sys.executable, *sys.argv]),
            **extra}


def describe_holder(holder: dict) -> str:
    """'process 1234 on host h (since 2026-01-01 10:00:00: python train.py ...)' from a holder record."""
    if not holder.get("pid"):
        return "another process"
    where = f" on host {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    command = holder.get("command", "")
    command = command if len(command) <= 300 else command[:297] + "..."
    details = "; ".join(part for part in (f"since {holder['since']}" if holder.get("since") else "",
                                          command) if part)
    return f"process {holder['pid']}{where}" + (f" ({details})" if details else "")


def _read_record(handle) -> dict:
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return {}
    try:
        record = json.loads(text)
    except ValueError:   # an older lock's "host:pid", or a record cut short
        host, _, pid = text.rpartition(":")
        return {"host": host, "pid": int(pid)} if pid.isdigit() else {}
    return record if isinstance(record, dict) else {}


class ProcessLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = None

    def acquire(self, record: dict | None = None) -> dict:
        """Takes the lock and writes `record` (own_record() when None) into it. Returns the record of a holder that
        ended without releasing it ({} when there was none). Raises LockHeld when a live process holds it, OSError
        when the file cannot be opened or its file system has no flock (Lustre mounted without it)."""
        try:
            import fcntl
        except ImportError:
            return {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(handle)
            handle.close()
            raise LockHeld(self.path, holder) from None
        except OSError:
            handle.close()
            raise
        stale = _read_record(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record or own_record()) + "\n")
        handle.flush()
        self._handle = handle
        return stale

    def release(self) -> None:
        """Empties the record (a released lock is not a stale one) and drops the lock."""
        if self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write("{}\n")
            self._handle.flush()
            self._handle.close()   # closing the file drops the flock
            self._handle = None
