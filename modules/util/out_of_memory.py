"""Saying that a run died because the host ran out of memory.

The kernel's OOM killer ends a process with SIGKILL: no handler runs, nothing is printed, the run's files are as
its last atomic write left them (every backup complete). What is left to say it happened:
- the launcher (`multi_gpu`'s, GenericTrainer's parent) sees a rank's exit status -9 (137 from a shell);
- the memory cgroup's `oom_kill` counter (cgroup v2 `memory.events`, v1 `memory.oom_control`) rose meanwhile.

So the workspace lock records the counter when a run starts, the next start that finds that run's stale lock
compares it (workspace_lock.py), and the launcher compares it for a rank killed by SIGKILL. Either says the memory
ran out, that the backups are intact, and what the host plan predicts (modules/planner/host_plan.py).
`WAN_TRAINER_MEMORY_EVENTS` names another events file (tests)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

EVENTS_VARIABLE = "WAN_TRAINER_MEMORY_EVENTS"
EVENT_FILES = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kills() -> int | None:
    """The memory cgroup's count of processes the OOM killer ended (None: no such counter here)."""
    paths = [os.environ[EVENTS_VARIABLE]] if os.environ.get(EVENTS_VARIABLE) else list(EVENT_FILES)
    for path in paths:
        try:
            text = Path(path).read_text(encoding="ascii")
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def start_record() -> dict:
    """What a run records when it starts (in its workspace lock), for the next start to compare."""
    kills = oom_kills()
    return {} if kills is None else {"oom_kills": kills}


def ran_out_since(record: dict) -> bool:
    """Whether the OOM killer ended a process of this memory group since `record` was taken."""
    before, now = record.get("oom_kills"), oom_kills()
    return before is not None and now is not None and now > before


MEMORY_RAN_OUT = ("the host's memory ran out: the kernel's OOM killer ended it (SIGKILL). Every backup written "
                  "before is complete (each is written whole, then renamed). To fit, see the predicted host RAM per "
                  "phase (`benchmark plan --peak-detail`, `--ram-gib`): fewer data.dataloader_threads, FLOAT_8 "
                  "transformer weights, less block swap or activation offload, or free memory on the machine")


def killed_rank_message(rank, exitcode: int, record: dict) -> str:
    """The launcher's line for a rank that ended with `exitcode` (negative: the signal): memory ran out when it was
    SIGKILL and the OOM counter rose since `record` (start_record()), else what is known."""
    if exitcode not in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return f"train: rank {rank} failed with exit code {exitcode}; the job was stopped"
    if ran_out_since(record):
        return f"train: rank {rank} was killed: {MEMORY_RAN_OUT}"
    return (f"train: rank {rank} was killed (SIGKILL, exit code {exitcode}): by the OOM killer when the host's "
            f"memory ran out, or by a user; every backup written before is complete; the job was stopped")
