"""One training job per workspace at a time (docs/reliability.md): the live job's process holds
`<workspace_dir>/training-lock.json` (modules/util/process_lock.py) from its start to its end.

Two jobs on one workspace would remove each other's temporaries as leftovers, resume from each other's newest
backup, write the same backup folders and replace each other's output. So a job whose workspace is held by a live
process is refused before it touches anything (ConfigError, exit code 2), naming that process; a lock whose holder
died (a SIGKILL, a power loss) is taken over with a line saying so. Only rank 0 of a multi-process job takes the
lock (and tells the others): ranks of one job never refuse each other."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from modules.util.config.ConfigError import ConfigError
from modules.util.process_lock import LockHeld, ProcessLock, describe_holder, own_record
from modules.util.ranks import broadcast_json, is_main

log = logging.getLogger(__name__)

LOCK_FILE = "training-lock.json"


def lock_path(workspace_dir: str | Path) -> Path:
    return Path(workspace_dir) / LOCK_FILE


def _take(workspace_dir: str | Path) -> tuple[ProcessLock | None, list[str]]:
    """(the lock held, []) or (None, the problems that refuse the run)."""
    path = lock_path(workspace_dir)
    lock = ProcessLock(path)
    from modules.util.out_of_memory import MEMORY_RAN_OUT, ran_out_since, start_record
    try:
        stale = lock.acquire({**own_record(), **start_record()})   # the OOM count: the next start compares it
    except LockHeld as held:
        pid = held.holder.get("pid")
        stop = f"stop it (kill {pid}), " if pid else ""
        return None, [f"workspace_dir: {str(workspace_dir)!r} is in use by another training job: "
                      f"{describe_holder(held.holder)} holds {path.name}. Two jobs on one workspace would write the "
                      f"same backups and resume from each other's. Wait for it to end, {stop}or set another "
                      f"workspace_dir"]
    except OSError as error:
        # a file system without flock (Lustre mounted without it): the job runs, unguarded, as it did before locks
        message = (f"warning: the workspace lock {path} cannot be taken ({error.strerror or error}): nothing keeps "
                   f"another job off this workspace while this one runs")
        print(message, flush=True)
        log.warning("%s", message)
        return None, []
    if stale:
        message = (f"note: took over the workspace lock {path} of {describe_holder(stale)}, which ended without "
                   f"releasing it (it was killed)")
        if ran_out_since(stale):
            message += f"; {MEMORY_RAN_OUT}"
        print(message, flush=True)
        log.info("%s", message)
    return lock, []


@contextlib.contextmanager
def workspace_locked(workspace_dir: str | Path) -> Iterator[None]:
    """Holds the workspace's lock for the block (rank 0; every rank raises the refusal alike)."""
    lock, problems = _take(workspace_dir) if is_main() else (None, [])
    problems = broadcast_json(problems)
    if problems:
        raise ConfigError(problems)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def check_workspace_free(workspace_dir: str | Path) -> None:
    """`multi_gpu`'s launcher, before it starts the ranks: a workspace in use refuses the job at once (the ranks
    take the lock themselves; a job that starts in between is refused by them)."""
    lock, problems = _take(workspace_dir)
    if problems:
        raise ConfigError(problems)
    lock.release()
