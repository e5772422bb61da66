"""The files a run's final save writes, and what happens to files already there: an output that another run (or
anything else) wrote is kept beside the new one as `<name>.previous-<that run>.safetensors` (a folder:
`<name>.previous-<that run>`; a file that records no run: named by its modification time), and the run plan and
the save say so. So is the run's own output from an earlier start when the resume trains on (a finished run given a
larger max_steps): `<name>.previous-<run>-<its time>.safetensors`. Only a resume at the run's last step, which trains
nothing and saves the same weights, replaces its own output."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from modules.trainer.errors import TrainingError

log = logging.getLogger(__name__)


def final_output_paths(trainer) -> list[Path]:
    """What `trainer.save_result(config.output.destination)` writes: the destination, or for Wan 2.2 A14B the
    expert files (modules/util/lora/formats.py expert_output_paths, WanBaseModelSaver.expert_file_path)."""
    config, model = trainer.config, trainer.model
    destination = Path(config.output.destination)
    method = config.training_method.value
    if method == "LORA" and model.variant.has_two_experts:
        from modules.util.lora.formats import expert_output_paths
        return list(expert_output_paths(destination, trainer.setup.experts_in_training()).values())
    if method == "FINE_TUNE" and config.output.format.value != "DIFFUSERS":
        from modules.modelSaver.wan.WanBaseModelSaver import expert_file_path
        return [expert_file_path(destination, expert, model) for expert in ("transformer", "transformer_2")
                if getattr(model, expert, None) is not None]
    return [destination]


def recorded_run(path: Path) -> str | None:
    """The run that wrote a file, as its header's training config records it (None when it records none)."""
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
        return json.loads(metadata.get("training_config") or "{}").get("run_name") or None
    except (OSError, ValueError, AttributeError, SafetensorError):  # another file, a damaged header: no run
        return None


def previous_path(path: Path, label: str) -> Path:
    """`lora.safetensors` -> `lora.previous-<label>.safetensors` (a folder: `model.previous-<label>`), with a counter
    when that exists too."""
    suffix = "" if path.is_dir() else path.suffix
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    target, number = path.with_name(f"{stem}.previous-{label}{suffix}"), 1
    while target.exists():
        number += 1
        target = path.with_name(f"{stem}.previous-{label}-{number}{suffix}")
    return target


def saves_its_own_weights_again(trainer) -> bool:
    """A resume at the run's last step trains nothing: its save writes the weights the run's own output holds."""
    resumed = trainer.resumed_step
    if resumed is None:
        return False
    total = getattr(trainer, "total_steps", 0)
    return resumed >= total if total else trainer.progress.global_step == resumed


def outputs_to_keep(trainer) -> list[tuple[Path, Path, str]]:
    """(existing output, the name it is kept under, who wrote it) for each file the final save would replace that
    this run did not write, or wrote at an earlier start: a finished run resumed to train on (a larger max_steps)
    replaces its finished output with other weights."""
    kept = []
    for path in final_output_paths(trainer):
        if not path.exists():
            continue
        run = recorded_run(path)
        written_at = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(path.stat().st_mtime))
        if run == trainer.run_name:
            if saves_its_own_weights_again(trainer):
                continue
            kept.append((path, previous_path(path, f"{run}-{written_at}"),
                         f"run {run} itself before this start (its output of {written_at})"))
            continue
        kept.append((path, previous_path(path, run or written_at),
                     f"run {run}" if run else "an earlier run or another program (it records no run)"))
    return kept


def plan_lines(trainer) -> list[str]:
    """The run plan's word on existing outputs."""
    return [f"    {path} exists, written by {who}: it is kept as {kept.name} before this run's save replaces it"
            for path, kept, who in outputs_to_keep(trainer)]


def keep_previous_outputs(trainer) -> list[tuple[Path, Path]]:
    """Keeps each existing output another run wrote beside it (rank 0, before the final save). A file gets a second
    name (a hard link, a copy where links are not possible), so it stays in place until the atomic save replaces it;
    a folder is renamed. Returns (output, kept as) for undo_kept_outputs."""
    kept_paths = []
    for path, kept, who in outputs_to_keep(trainer):
        try:
            if path.is_dir():
                os.replace(path, kept)
            else:
                try:
                    os.link(path, kept)
                except OSError:
                    shutil.copy2(path, kept)
        except OSError as error:
            if kept.is_file():  # a copy cut short
                kept.unlink()
            raise TrainingError(f"the earlier output {path} (written by {who}) cannot be kept as {kept.name}: "
                                f"{error.strerror or error}; it was not overwritten. Free space, or choose another "
                                f"output.destination, and resume (backup.continue_last_backup=true)") from None
        message = f"note: {path} was written by {who}: kept as {kept} (this run's save replaces {path.name})"
        print(message, flush=True)
        log.info("%s", message)
        trainer.on_update({"note": message})
        kept_paths.append((path, kept))
    return kept_paths


def undo_kept_outputs(kept_paths: list[tuple[Path, Path]]) -> None:
    """After a save that failed (its files were not replaced): the second names go, a renamed folder returns."""
    for path, kept in kept_paths:
        if kept.is_dir():
            if not path.exists():
                os.replace(kept, path)
        elif path.is_file():
            kept.unlink(missing_ok=True)
