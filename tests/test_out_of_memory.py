"""A run the OOM killer ends (SIGKILL, no handler runs) leaves every backup complete, and the next start and the
multi-GPU launcher say that the host's memory ran out (modules/util/out_of_memory.py). The memory cgroup's
`oom_kill` counter is read from a file the test names (WAN_TRAINER_MEMORY_EVENTS), raised as the kernel would."""
import os
import signal
import subprocess
import sys
from pathlib import Path

from modules.util.out_of_memory import EVENTS_VARIABLE, killed_rank_message

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_killed_when_memory_ran_out_keeps_its_backups_and_the_next_start_says_so(
        tiny_model, squares_dataset, tmp_path, monkeypatch, capsys):
    from modules.trainer.backup_io import all_backups, verify_backup
    from modules.trainer.workspace_lock import workspace_locked
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 2\noom_kill 2\n")
    workspace = tmp_path / "ws"
    command = [sys.executable, str(ROOT / "scripts" / "train.py")]
    for value in (f"model.base_model_name={tiny_model('wan2.1-t2v')}", f"workspace_dir={workspace}",
                  f"cache_dir={tmp_path / 'cache'}", f"output.destination={tmp_path / 'out.safetensors'}",
                  "device=cpu", "train_dtype=FLOAT_32", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                  "data.frame_buckets=[9]", "data.resolution=32", "data.dataloader_threads=0", "max_steps=4",
                  "epochs=10", "backup.every_n_steps=1", "tensorboard=false"):
        command += ["--config-value", value]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=str(ROOT),
                            env={**os.environ, "WAN_TRAINER_KILL_AT": "step:3", EVENTS_VARIABLE: str(events),
                                 "PYTHONUNBUFFERED": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    backups = all_backups(workspace / "backup")
    assert backups and all(verify_backup(backup) == [] for backup in backups), backups
    events.write_text("low 0\nhigh 0\nmax 3\noom 3\noom_kill 3\n")   # the kernel's OOM killer ended it
    monkeypatch.setenv(EVENTS_VARIABLE, str(events))
    with workspace_locked(workspace):
        pass
    said = capsys.readouterr().out
    assert "took over the workspace lock" in said and "the host's memory ran out" in said, said
    assert "Every backup written before is complete" in said


def test_a_killed_run_is_not_said_out_of_memory_without_the_counter(tiny_model, tmp_path, monkeypatch, capsys):
    """A lock left by a run ended while the OOM counter stayed put: killed, not said to be out of memory."""
    import json
    from modules.trainer.workspace_lock import lock_path, workspace_locked
    events = tmp_path / "memory.events"
    events.write_text("oom_kill 5\n")
    monkeypatch.setenv(EVENTS_VARIABLE, str(events))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    lock_path(workspace).write_text(json.dumps({"host": "h", "pid": 999999, "oom_kills": 5}) + "\n")
    with workspace_locked(workspace):
        pass
    said = capsys.readouterr().out
    assert "took over the workspace lock" in said and "memory ran out" not in said, said


def test_the_launcher_says_a_rank_sigkilled_when_memory_ran_out(tmp_path, monkeypatch):
    events = tmp_path / "memory.events"
    events.write_text("oom_kill 7\n")
    monkeypatch.setenv(EVENTS_VARIABLE, str(events))
    record = {"oom_kills": 6}
    assert "the host's memory ran out" in killed_rank_message(1, -signal.SIGKILL, record)
    assert "the host's memory ran out" in killed_rank_message(1, 137, record)
    assert "or by a user" in killed_rank_message(1, -signal.SIGKILL, {"oom_kills": 7})
    assert killed_rank_message(1, 1, record) == "train: rank 1 failed with exit code 1; the job was stopped"
