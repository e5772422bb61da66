"""The files a run leaves in its workspace besides backups: leftovers of killed writes (removed at the next start)
and intermediate saves (kept to the newest `backup.save_rolling_count`)."""
import logging
import re
import shutil
from pathlib import Path

from modules.util.atomic import remove_stale_temporaries
from modules.util.config.TrainConfig import TrainConfig

log = logging.getLogger(__name__)

# workspace/save/step-00000040.safetensors, epoch-0003_high_noise.safetensors, step-00000040 (a diffusers folder)
_SAVE_NAME = re.compile(r"^(step|epoch)-(\d+)")


def save_folder(config: TrainConfig) -> Path:
    return Path(config.workspace_dir) / "save"


def remove_leftover_temporaries(config: TrainConfig) -> list[Path]:
    """Removes what writes killed mid-way left behind (`.step-N.*.tmp/` backup folders, `.lora.safetensors.*.tmp`,
    sample `.mp4.*.tmp`, cache entries) in this run's workspace and cache, and temporaries of the output file beside
    it (only those named after it: the output folder may hold the user's other files)."""
    removed = remove_stale_temporaries([config.workspace_dir, config.cache_dir])
    destination = Path(config.output.destination)
    removed += remove_stale_temporaries([destination.parent], recursive=False, prefix=destination.stem)
    for path in removed:
        log.info("removed %s, left by a write that was interrupted", path)
    if removed:
        print(f"removed {len(removed)} temporary file(s) left by an interrupted run (e.g. {removed[0]})", flush=True)
    return removed


def prune_saves(folder: Path, keep: int) -> list[Path]:
    """Keeps the intermediate saves of the newest `keep` save points (0: all); a save point's files (both experts'
    of Wan 2.2 A14B) go together. Returns what was removed."""
    if keep <= 0 or not folder.is_dir():
        return []
    groups: dict[str, list[Path]] = {}
    for path in folder.iterdir():
        match = _SAVE_NAME.match(path.name)
        if match and not path.name.startswith("."):
            groups.setdefault(match.group(0), []).append(path)
    # newest last: by the time the point was written (a run may mix step and epoch saves)
    ordered = sorted(groups, key=lambda name: (max(p.stat().st_mtime_ns for p in groups[name]), name))
    removed = []
    for name in ordered[:-keep]:
        for path in groups[name]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed
