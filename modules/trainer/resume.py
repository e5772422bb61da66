"""Continuing a run from its backup: which backup (the newest of the run that verifies, checksums included),
what is done with the damaged ones skipped on the way, and the restore itself."""
import logging
from pathlib import Path

from modules.trainer.backup_io import (ResumeChoice, choose_backup, config_changes, prune_backups, read_backup,
                                       set_aside)
from modules.trainer.distributed_checkpoint import restore_backup_state
from modules.trainer.errors import TrainingError
from modules.trainer.parameter_groups import group_mismatch
from modules.trainer.run_matching import run_to_continue
from modules.util.config.ConfigError import ConfigError
from modules.util.config.config_io import config_to_dict
from modules.util.ranks import broadcast_json

log = logging.getLogger(__name__)


def choose_resume(trainer) -> ResumeChoice:
    """The backup to continue (rank 0 verifies it, checksums included, and tells the others). Refuses, before any
    model loads, a workspace whose runs all have other settings (ConfigError) and a run whose every backup is
    damaged, now or at an earlier resume (TrainingError): starting fresh would replace its output."""
    shared = None
    if trainer.parallel.is_main:
        try:
            name = trainer.config.run_name or run_to_continue(trainer.backup_base, trainer.config)
            choice = choose_backup(trainer.backup_base, name)
            shared = [choice.run_name, choice.folder and str(choice.folder),
                      [[str(folder), problems] for folder, problems in choice.damaged],
                      [str(folder) for folder in choice.set_aside], None]
        except ConfigError as error:
            shared = [None, None, [], [], error.problems]
    shared = broadcast_json(shared)
    if shared[4]:
        raise ConfigError(shared[4])
    choice = ResumeChoice(shared[0], Path(shared[1]) if shared[1] else None,
                          [(Path(folder), problems) for folder, problems in shared[2]], [Path(p) for p in shared[3]])
    if choice.folder is None and (choice.damaged or choice.set_aside):
        if trainer.parallel.is_main:
            set_aside_damaged(choice)
        # starting fresh here would end by replacing the output with a model that forgot every trained step; a
        # retry finds the backups set aside and must stop again
        aside = ", ".join(p.name for p in choice.set_aside)
        where = f"set aside earlier as {aside} in {choice.set_aside[0].parent}" if choice.set_aside and not \
            choice.damaged else "set aside as *.damaged, see the warnings above"
        raise TrainingError(f"backup.continue_last_backup: every backup of run {choice.run_name} is damaged "
                            f"({where}); nothing was resumed or overwritten. Set backup.continue_last_backup=false "
                            f"to train the run again from step 0, or another run_name to start a new run")
    return choice


def set_aside_damaged(choice: ResumeChoice) -> None:
    """Renames the damaged backups a resume skipped to `step-N.damaged`, with a warning each."""
    for bad, problems in choice.damaged:
        moved = set_aside(bad)
        text = f"backup {bad} is damaged and is skipped ({'; '.join(problems)})" + (
            f"; moved to {moved}" if moved else "")
        log.warning("%s", text)
        print(f"warning: {text}" + (f"; resuming from {choice.folder} instead" if choice.folder else ""), flush=True)


def resume(trainer) -> None:
    """Restores the chosen backup into `trainer` (every rank), after its damaged newer ones are set aside."""
    choice = trainer.resume_choice
    folder = choice.folder
    if trainer.parallel.is_main:
        set_aside_damaged(choice)
    if folder is None:
        log.warning("backup.continue_last_backup is set, but %s holds no usable backup%s: starting fresh",
                    trainer.backup_base, f" of run {choice.run_name}" if choice.run_name else "")
        return
    try:
        state = read_backup(folder)
    except Exception as error:  # noqa: BLE001  (damage the size and header checks cannot see)
        raise TrainingError(f"the backup {folder} cannot be read: {error}") from error
    mismatch = group_mismatch(state["optimizer"], trainer.optimizer)  # every rank reads the same backup
    if mismatch:
        raise TrainingError(f"cannot resume from {folder}: {mismatch}")
    try:
        restore_backup_state(trainer, state)  # weights, optimizer state (sharded or not) and this rank's RNG
    except (RuntimeError, KeyError, ValueError) as error:  # names or shapes differ: the settings changed
        changes = config_changes(folder, config_to_dict(trainer.config))
        raise TrainingError(f"cannot resume from {folder}: its trained tensors do not fit this run "
                            f"({str(error).splitlines()[0]}); " + (f"changed since: {'; '.join(changes)}. " if
                            changes else "") + "Resume with the settings it was written with, or set "
                            f"backup.continue_last_backup=false (or another run_name) to start a new run") from None
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.ema is not None and state["ema"] is not None:
        trainer.ema.load_state_dict(state["ema"])
    trainer.progress = state["progress"]
    trainer.backed_up_step = trainer.resumed_step = trainer.progress.global_step
    if trainer.parallel.is_main:
        print(choice.describe(), flush=True)
        # a run killed between writing a backup and pruning the older ones keeps its rolling limit
        prune_backups(trainer.backup_root, trainer.config.backup.rolling_count)
    trainer.on_update({"resumed_from": trainer.progress.global_step, "run": trainer.run_name, "backup": str(folder)})


def note_untrained_save(trainer) -> None:
    """A resume at the run's last step trains nothing and only saves (how a failed save is retried): said, so a
    model that trained no step never replaces a file unannounced."""
    resumed = trainer.resumed_step
    if resumed is None or trainer.progress.global_step != resumed or not trainer.parallel.is_main:
        return
    destination = Path(trainer.config.output.destination)
    replacing = f", replacing the existing {destination}" if destination.exists() else ""
    message = (f"note: run {trainer.run_name} was resumed at step {resumed}, its last step: no step was trained; "
               f"the backup's weights are saved{replacing}")
    print(message, flush=True)
    trainer.on_update({"note": message})
