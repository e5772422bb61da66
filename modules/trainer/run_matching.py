"""Which run `backup.continue_last_backup` continues when no `run_name` is given: the newest run of the workspace
whose settings are this run's (the same output, a backup not past max_steps).

A run killed before its first backup has no backup of its own. Continuing whichever run wrote last would save that
run's weights under this run's output and record this run's settings as that run's, so when no run matches the
resume is refused, naming each run and the `run_name=` that continues it anyway."""
import json
import os
from pathlib import Path

from modules.trainer.backup_io import PROGRESS_FILE, set_aside_backups, workspace_backups, written_at
from modules.util.config.ConfigError import ConfigError
from modules.util.config.TrainConfig import TrainConfig


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _workspace_runs(backup_base: Path) -> list[tuple[str, list[Path]]]:
    """(run name, its backups and set-aside backups, oldest first), newest run first."""
    runs = {name: list(found) for name, found in workspace_backups(backup_base).items()}
    if backup_base.is_dir():
        for entry in backup_base.iterdir():
            aside = set_aside_backups(entry) if entry.is_dir() else []
            if aside:
                runs[entry.name] = sorted(runs.get(entry.name, []) + aside, key=written_at)
    return sorted(runs.items(), key=lambda item: written_at(item[1][-1]), reverse=True)


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or Path(a).resolve() == Path(b).resolve()


def run_differences(backup_base: Path, name: str, backups: list[Path], config: TrainConfig) -> list[str]:
    """Why run `name` is not the run `config` describes ([] when it is, or when its settings cannot be read)."""
    newest = backups[-1]
    recorded = _read_json(newest / "config.json") or _read_json(backup_base.parent / "run-configs" / f"{name}.json")
    differences = []
    destination = ((recorded or {}).get("output") or {}).get("destination")
    if destination and not _same_path(str(destination), config.output.destination):
        differences.append(f"it writes {destination!r}, this run {config.output.destination!r}")
    step = (_read_json(newest / PROGRESS_FILE) or {}).get("global_step")
    if config.max_steps and isinstance(step, int) and step > config.max_steps:
        differences.append(f"its newest backup is at step {step}, past this run's max_steps {config.max_steps}")
    return differences


def run_to_continue(backup_base: Path, config: TrainConfig) -> str:
    """The run a resume without `run_name` continues ('' when the workspace holds none: the run starts fresh).
    Raises ConfigError when runs exist but none has this run's settings."""
    runs = _workspace_runs(backup_base)
    refused = []
    for name, backups in runs:
        differences = run_differences(backup_base, name, backups, config)
        if not differences or not name:  # a backup of an earlier version that records no run: as before
            return name
        refused.append((name, differences))
    if not refused:
        return ""
    lines = [f"run {name}: {'; '.join(differences)}" for name, differences in refused[:3]]
    more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
    raise ConfigError([f"backup.continue_last_backup: no run in {backup_base} has this run's settings, so none is "
                       f"continued{more}: " + " | ".join(lines) + f". To continue one anyway, set "
                       f"run_name={refused[0][0]} (its name); to start this run anew, set "
                       f"backup.continue_last_backup=false"])
