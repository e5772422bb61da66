"""The training loop: cache, then per batch predict -> loss -> backward -> (every accumulation) optimizer step,
with samples, backups and saves between optimizer steps. Resume restores the exact data position and RNG."""
import hashlib
import itertools
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from modules.trainer.backup_io import (ResumeChoice, TrainProgress, newest_usable_backup, non_finite_tensors,
                                       prune_backups, write_backup)
from modules.trainer.distributed import gradient_norm, join_process_group
from modules.trainer.ParallelLayout import Parallel
from modules.trainer.distributed_checkpoint import RANKS_FILE, gather_backup_state, keep_global_batch
from modules.trainer.errors import BackupWriteError, TrainingError
from modules.trainer.loss_bearing import check_something_trained, count_loss_bearing
from modules.trainer.optimizers import EMA, create_lr_scheduler, create_optimizer
from modules.trainer.output_files import keep_previous_outputs, undo_kept_outputs
from modules.trainer.parameter_groups import parameter_groups
from modules.trainer.preview_prompts import check_samples, release_text_encoder
from modules.trainer.resume import choose_resume, note_untrained_save, resume
from modules.trainer.run_report import PlanError, end_report, plan_run, resolve_run_name, start_report
from modules.trainer.workspace_lock import workspace_locked
from modules.util.config.config_io import ConfigError, config_to_dict, save_config
from modules.util.config.TrainConfig import TrainConfig
from modules.trainer.prepare import check_model_variant
from modules.util.devices import resolve_device
from modules.util.interrupts import install_sigint, interrupt_raises
from modules.util.kill_points import kill_point, phase
from modules.util.ranks import any_rank, barrier, broadcast_json
from modules.util.registry import lookup

log = logging.getLogger(__name__)


def step_seed(seed: int, micro_step: int) -> int:
    """The noise and sigmas of a batch depend only on (seed, batch number): a resumed run draws the same ones."""
    digest = hashlib.sha256(f"{seed}:{micro_step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class GenericTrainer:
    def __init__(self, config: TrainConfig, on_update: Callable[[dict], None] | None = None,
                 e2v_datasets: list | None = None):
        """`e2v_datasets`: what prepare_config returned (resolved here when not given)."""
        self.config = config
        if e2v_datasets is None and config.e2v.enabled:
            from modules.util.config.e2v_setup import resolve_e2v_datasets
            e2v_datasets = resolve_e2v_datasets(config)   # E2V bases (Wan 2.1) have the default unit, 16
        self.e2v_datasets = e2v_datasets or []
        self.on_update = on_update or (lambda _info: None)
        self.workspace = Path(config.workspace_dir)
        self.backup_base = self.workspace / "backup"   # backup/<run name>/step-N: see backup_io
        self.resume_choice: ResumeChoice | None = None
        self.resumed_step: int | None = None  # the step a resume continued from
        self._writing: str | None = None      # what a Ctrl-C must let finish (the final backup or save)
        self.completed = False                # the output was written
        self.stop_requested = threading.Event()
        self._requests: set[str] = set()   # REQUESTS made from another thread (the GUI), served between steps
        self._requests_lock = threading.Lock()
        self.step_losses: list[float] = []
        # (step, loss, grad norm) still on the device: read back every performance.loss_readback_steps steps
        self.pending_losses: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        # per pending step, this rank's loss elements that carry weight (BaseWanSetup.loss_bearing_elements)
        self.pending_bearing: list[torch.Tensor] = []
        self.loss_bearing_steps = self.empty_steps = 0   # this session's steps with / without one
        self.progress = TrainProgress()
        self.backed_up_step: int | None = None  # the step this run last wrote (or resumed from) a backup of
        # under torchrun: this rank's device, in the process group
        self.device = join_process_group(config) or resolve_device(config.device)
        self.parallel = Parallel(config)
        self.model = self.setup = self.data = None
        self.validation = None  # the ValidationEvaluator when items are held out
        self.plan = None
        self.run_name = config.run_name

    @property
    def backup_root(self) -> Path:
        """This run's backup folder."""
        return self.backup_base / self.run_name if self.run_name else self.backup_base

    @property
    def tensorboard_dir(self) -> Path:
        return self.workspace / "tensorboard" / self.run_name

    @property
    def samples_dir(self) -> Path:
        return self.workspace / "samples" / self.run_name

    # ---- construction --------------------------------------------------------------------------------------

    def _load(self) -> None:
        from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
        import modules.modelLoader.WanModelLoader  # noqa: F401  (registers)
        import modules.modelSetup.WanEmbeddingSetup  # noqa: F401
        import modules.modelSetup.WanFineTuneSetup  # noqa: F401
        import modules.modelSetup.WanLoRASetup  # noqa: F401

        from modules.dataLoader.WanBaseDataLoader import DataError
        from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError
        from modules.modelLoader.wan.parts.model_plan import detect_model_variant
        from modules.util.wan_detection import NotAWanModelError

        config = self.config
        base = Path(config.model.base_model_name)
        # the data is scanned before any model loads: no usable item is an error that costs nothing
        e2v_datasets = self.e2v_datasets
        try:
            self.data = WanBaseDataLoader(config, detect_model_variant(config.model) if base.is_dir() else None,
                                          e2v_datasets)
            self.data.scan()
            if problems := self.data.companion_problems():
                raise ConfigError(problems)
            self.model = lookup("model_loader", config.model_type, config.training_method)().load(config.model)
        except (DataError, ModelLoadError, NotAWanModelError) as error:
            raise TrainingError(str(error)) from None
        if not base.is_dir():  # a hub id: its variant is known only now
            check_model_variant(config, self.model.variant, config.model.base_model_name)
        if e2v_datasets and not (self.model.variant.is_vace and config.e2v.as_vace_references):
            from modules.model.e2v_model import prepare_e2v_model
            prepare_e2v_model(self.model, e2v_datasets[0])
        self.setup = lookup("model_setup", config.model_type, config.training_method)(config, self.model)
        self.setup.device = self.device
        self.data.attach_model(self.model, self.device)

    def cache_only(self) -> None:
        with workspace_locked(self.config.workspace_dir):
            self._remove_leftovers()
            self._load()
            self._cache()

    def _remove_leftovers(self) -> None:
        """Temporaries of writes a killed run left; one rank removes them before any rank writes (a concurrent
        writer's temporary looks the same)."""
        from modules.trainer.workspace_files import remove_leftover_temporaries
        if self.parallel.is_main:
            remove_leftover_temporaries(self.config)
        barrier()

    def _cache(self, release_text: bool = False) -> bool:
        """Fills the caches; False when Ctrl-C stopped it (every entry written so far is complete and kept).
        `release_text`: a training run releases the text encoder after its pass, before the VAE pass, unless it
        needs it later (released_parts.released_before_vae_pass)."""
        from modules.dataLoader.DiskCache import CacheWriteError
        from modules.model.released_parts import released_before_vae_pass
        early = release_text and released_before_vae_pass(self.config)
        after_text = self._release_text_encoder if early else None
        try:
            with phase("caching"), interrupt_raises():
                # random windows / crops: every epoch
                self.data.cache(epochs=self._plan().epochs, after_text=after_text)
        except CacheWriteError as error:
            raise TrainingError(str(error)) from None
        except KeyboardInterrupt:
            print("\ncaching stopped by Ctrl-C; the entries cached so far are kept, and the next run continues "
                  "from them", flush=True)
            self.stop_requested.set()
            return False
        return True

    def _release_text_encoder(self) -> None:
        release_text_encoder(self)

    # ---- training ------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stop_requested.set()

    REQUESTS = ("sample", "backup", "save")

    def request(self, action: str) -> None:
        """'sample', 'backup' or 'save' now: done at the next safe point, after the current optimizer step.
        Thread-safe (the GUI calls it from its main thread while the loop runs in a worker)."""
        if action not in self.REQUESTS:
            raise ValueError(f"unknown request {action!r}; one of {', '.join(self.REQUESTS)}")
        with self._requests_lock:
            self._requests.add(action)

    def _serve_requests(self) -> None:
        with self._requests_lock:
            actions, self._requests = self._requests, set()
        if "sample" in actions:
            if self.hooks.sampler is None:
                log.warning("sample now: no samples file is configured (sampling.samples_file)")
            else:
                self.hooks._sample()
        if "backup" in actions:
            self.backup()
        if "save" in actions:  # the same files and rolling count as a scheduled intermediate save
            self.hooks._intermediate_save(f"step-{self.progress.global_step:08d}")

    def train(self) -> list[Path]:
        # held from before the leftovers are removed and a backup is chosen: another live job's would be taken
        with workspace_locked(self.config.workspace_dir):
            return self._train()

    def _train(self) -> list[Path]:
        config = self.config
        torch.manual_seed(config.seed)
        self._remove_leftovers()
        if config.backup.continue_last_backup:  # which run continues is decided before any model loads
            self.resume_choice = choose_resume(self)
        self._load()
        check_samples(self)
        if not self._cache(release_text=True):
            return []
        self.setup.setup_model()
        from modules.modelSetup.distill_preserve import PreserveTraining
        # distill.mode preserve: the frozen accelerator (and the empty caption, before the text encoder is released)
        self.setup.preserve = PreserveTraining.for_run(config, self.model, self.device)
        if config.training_method.value == "EMBEDDING":
            self.model.text_encoder.to(self.device)
        elif self.model.text_encoder is not None:   # released here when distill.mode preserve needed it till now
            self._release_text_encoder()

        # several ranks: rank 0's name (the start time, its folder reserved) for all
        self.run_name = broadcast_json(resolve_run_name(config, self.workspace, self.resume_choice)
                                       if self.parallel.is_main else None)
        config.run_name = self.run_name  # backups record it: a resume continues this run's log and previews
        if config.backup.continue_last_backup:
            try:
                keep_global_batch(self)
            except ValueError as error:
                raise TrainingError(str(error)) from None
        self.parallel.wrap(self.setup, self.model, self.device)  # places the experts on the device(s)
        parameters = self.setup.trainable_parameters()
        self.optimizer = create_optimizer(config.optimizer,
                                          parameter_groups(config, self.setup.named_trainable_parameters()))
        self.plan = self._plan()  # again: caching may have left out files that failed to decode
        self.total_steps = self.plan.total_steps
        self.scheduler = create_lr_scheduler(config.optimizer, self.optimizer, self.total_steps)
        self.ema = EMA(parameters, config.optimizer.ema_decay) if config.optimizer.ema else None
        if config.backup.continue_last_backup:
            resume(self)
        # after the resume: a resume refused for changed settings must leave the run's recorded config as it was
        config_path = self.workspace / "run-configs" / f"{self.run_name}.json"
        if self.parallel.is_main:
            save_config(config, config_path)
        from modules.trainer.ValidationEvaluator import ValidationEvaluator
        self.validation = ValidationEvaluator.create(self)
        if self.parallel.is_main:
            self.plan_report = start_report(self, parameters)   # the window shows it too (log pane, end panel)
            print(self.plan_report, flush=True)

        from modules.trainer.TrainingHooks import TrainingHooks
        self.hooks = TrainingHooks(self)
        # installed until the output is written: a Ctrl-C during the final backup or save lets it finish
        previous_handler = self._install_sigint()
        try:
            try:
                self.hooks.before_training()
                if self.validation is not None:
                    self.validation.before_training()
                self._run_epochs(parameters, self.plan.batches_per_epoch, self.plan.accumulation)
                if self.validation is not None and not self.stop_requested.is_set():
                    self.validation.at_end()
            finally:
                self.hooks.close()
            if self.stop_requested.is_set():
                return []
            check_something_trained(self)
            if config.backup.backup_before_save and self.backed_up_step != self.progress.global_step:
                self._writing = "the backup before the final save"
                try:
                    self.backup()  # the final save may fail (a full disk): the weights must exist somewhere first
                except BackupWriteError as error:
                    if self.parallel.enabled:  # the other ranks would wait in the save's collectives
                        raise
                    # the backup's disk is full, the output's may not be: the save is the weights' last chance
                    log.warning("%s; saving the output anyway", error.failure)
                else:
                    if self.stop_requested.is_set():  # Ctrl-C during that backup: it is complete, the save waits
                        return []
            note_untrained_save(self)
            kept = keep_previous_outputs(self) if self.parallel.is_main else []
            if self.ema is not None:
                self.ema.copy_to_parameters()
            self._writing = f"the final save of {config.output.destination}"
            try:
                written = self.save_result(config.output.destination)
            except TrainingError:
                undo_kept_outputs(kept)  # the earlier files are intact: no second name for them is left
                raise
            self.completed = True
        finally:
            self._writing = None
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
        if self.parallel.is_main:
            print(end_report(self, written, config_path), flush=True)
        return written

    def _plan(self):
        try:
            return plan_run(self.config, self.data.batches_per_epoch())
        except PlanError as error:
            raise TrainingError(str(error)) from None

    def _run_epochs(self, parameters, batches_per_epoch: int, accumulation: int) -> None:
        from tqdm import tqdm
        config, progress = self.config, self.progress
        step_bar = tqdm(total=self.total_steps, initial=progress.global_step, desc="steps", unit="step",
                        disable=not self.parallel.is_main)
        micro_losses: list[torch.Tensor] = []
        micro_bearing: list[torch.Tensor] = []
        readback = config.performance.loss_readback_steps
        step_started = time.perf_counter()
        if self.total_steps and progress.global_step >= self.total_steps:
            step_bar.close()
            return  # resumed from a backup written at the end (a final save that did not finish): only save
        try:
            # max_steps, when set, wins over epochs: the epochs repeat until it is reached
            epochs = itertools.count(progress.epoch) if config.max_steps else range(progress.epoch, self.plan.epochs)
            for epoch in epochs:
                if config.max_steps and progress.global_step >= config.max_steps:
                    return
                start = progress.epoch_batch if epoch == progress.epoch else 0
                progress.epoch, progress.epoch_batch = epoch, start
                if start == 0 and self.data.batches_per_epoch(epoch) == 0:
                    raise TrainingError(f"epoch {epoch} has no batch: the data gave out before max_steps")
                for batch in self.data.batches(epoch, start):
                    generator = torch.Generator().manual_seed(step_seed(config.seed, progress.micro_step))
                    self.parallel.sync_gradients((progress.micro_step + 1) % accumulation == 0)
                    with self.setup.training_step():
                        loss, prediction = self.parallel.forward(self.setup, batch, generator)
                        (loss / accumulation).backward()
                    # no .item() here: reading a value waits for the device (see read_losses); several ranks: the
                    # global batch's loss, so every rank stops alike on a non-finite one
                    micro_losses.append(self.parallel.global_loss(loss))
                    micro_bearing.append(self.setup.loss_bearing_elements(batch, prediction))
                    progress.micro_step += 1
                    progress.epoch_batch += 1
                    self.hooks.after_batch(batch, prediction)
                    if progress.micro_step % accumulation:
                        continue

                    kill_point("step")
                    grad_norm = self._optimizer_step(parameters)
                    progress.global_step += 1
                    self.pending_losses.append((progress.global_step, torch.stack(micro_losses).mean(0), grad_norm))
                    self.pending_bearing.append(torch.stack(micro_bearing).sum())
                    micro_losses.clear()
                    micro_bearing.clear()
                    last = config.max_steps and progress.global_step >= config.max_steps
                    if progress.global_step % readback == 0 or last or self.stop_requested.is_set():
                        self.read_losses()
                    step_time = time.perf_counter() - step_started
                    step_started = time.perf_counter()
                    step_loss = self.hooks.last_loss
                    self.hooks.after_step(step_loss, step_time)
                    if self.validation is not None:
                        self.validation.after_step()
                    self._serve_requests()
                    step_bar.set_postfix(epoch=epoch, loss="-" if step_loss is None else f"{step_loss:.4f}",
                                         lr=f"{self.scheduler.get_last_lr()[0]:.2e}", s_step=f"{step_time:.2f}")
                    step_bar.update()
                    if any_rank(self.stop_requested.is_set()):
                        self.backup()
                        return
                    if config.max_steps and progress.global_step >= config.max_steps:
                        return
                progress.epoch, progress.epoch_batch = epoch + 1, 0
                self.read_losses()
                self.hooks.after_epoch(epoch)
            self.read_losses()
        finally:
            step_bar.close()

    def read_losses(self) -> None:
        """Reads the pending steps' losses and gradient norms back from the device in one transfer (the only place
        the loop waits for the device), logs them, and raises TrainingError at the first non-finite loss. Runs
        every performance.loss_readback_steps steps and before every backup and save, so nothing non-finite is
        ever written."""
        if not self.pending_losses:
            return
        steps = [step for step, _, _ in self.pending_losses]
        # a loss is one value, or one per expert with expert parallel (Parallel.global_loss): the step's is their mean
        values = torch.stack([torch.cat([loss.float().reshape(-1), norm.float().to(loss.device).reshape(1),
                                         bearing.float().to(loss.device).reshape(1)])
                              for (_, loss, norm), bearing in zip(self.pending_losses, self.pending_bearing)]).tolist()
        self.pending_losses.clear()
        self.pending_bearing.clear()
        for step, (*parts, grad_norm, bearing) in zip(steps, values):
            count_loss_bearing(self, step, bearing)
            loss = sum(parts) / len(parts)
            if not math.isfinite(loss):
                raise TrainingError(self._nan_message(step, loss))
            self.step_losses.append(loss)
            self.hooks.log_loss(step, loss, grad_norm, parts if len(parts) > 1 else None)

    def _optimizer_step(self, parameters) -> torch.Tensor:
        """The gradient norm stays on the device (read back with the loss)."""
        clip = self.config.optimizer.clip_grad_norm
        grad_norm = self.parallel.global_norm(gradient_norm(parameters, clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.setup.after_optimizer_step()
        if self.ema is not None:
            self.ema.update()
        return grad_norm

    def _nan_message(self, step: int, loss: float) -> str:
        kept = self._last_backup_text()
        return (f"the loss became {loss} at step {step} (epoch {self.progress.epoch}); training stopped and "
                f"{kept}. Lower the learning rate or check the data.")

    # ---- SIGINT --------------------------------------------------------------------------------------------

    def _install_sigint(self):
        """The training loop's handler (the previous one returned; None outside the main thread, where the GUI's
        worker stops through request_stop())."""
        def handle(_signum, _frame):
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            if self._writing:
                print(f"\nfinishing {self._writing} first, then stopping (Ctrl-C again to abort)", flush=True)
            else:
                print("\nstopping after this step and writing a backup (Ctrl-C again to abort)", flush=True)
            self.stop_requested.set()

        return install_sigint(handle)

    # ---- backup, resume, save ------------------------------------------------------------------------------

    def _last_backup_text(self) -> str:
        """'the last good backup is <folder>' (every backup written holds finite weights), or that there is none."""
        folder, _ = newest_usable_backup(self.backup_root)
        return f"the last good backup is {folder}" if folder else "no backup was written yet"

    def backup(self, folder: Path | None = None, extra_json: dict | None = None) -> Path:
        """A rolling backup (`step-N`, pruned to backup.rolling_count), or one into `folder` that is not pruned
        (validation.keep_best's `best`); `extra_json`: more files, name -> JSON value."""
        self.read_losses()  # never back up weights a non-finite loss has touched
        self.setup.release_host_buffers()   # the offloaded inputs' buffers: room for the copies below
        rolling = folder is None
        folder = folder or self.backup_root / f"step-{self.progress.global_step:08d}"
        trainable, optimizer_state, rng, layout = gather_backup_state(self)  # every rank takes part
        if self.parallel.is_main:
            broken = non_finite_tensors(trainable)
            if broken:
                raise TrainingError(f"the trained weights became non-finite by step {self.progress.global_step} "
                                    f"({len(broken)} of {len(trainable)} tensors, e.g. {broken[0]}); no backup was "
                                    f"written from them, training stopped and {self._last_backup_text()}. Lower the "
                                    f"learning rate or check the data.")
            try:
                with phase("backup"):
                    write_backup(folder, self.progress, trainable, optimizer_state, self.scheduler, self.ema,
                                 config_to_dict(self.config), rng=rng,
                                 extra_json={RANKS_FILE: layout, **(extra_json or {})})
            except Exception as error:  # noqa: BLE001  (safetensors raises its own error type for a full disk)
                raise BackupWriteError(f"writing the backup {folder} failed: {error}",
                                       self._last_backup_text()) from error
            if rolling:
                prune_backups(self.backup_root, self.config.backup.rolling_count)
            log.info("backup written to %s", folder)
        barrier()
        if rolling:
            self.backed_up_step = self.progress.global_step
        return folder

    def save_result(self, destination: str) -> list[Path]:
        self.read_losses()
        self.setup.release_host_buffers()
        output = self.config.output
        written = []
        try:
            with phase("save"), self.parallel.gathered(self.model):  # sharded: the whole transformer on rank 0
                if self.parallel.is_main:
                    written = self.setup.save_result(destination, output.format, output.dtype.torch_dtype(),
                                                     config_to_dict(self.config))
        except Exception as error:  # noqa: BLE001  (safetensors raises its own error type for a full disk)
            raise TrainingError(self._save_failed_message(destination, error)) from error
        barrier()
        for path in written:
            print(f"saved {path}", flush=True)
        if written and not getattr(self, "format_notes_printed", False):  # once a run, intermediate saves too
            self.format_notes_printed = True
            from modules.util.lora.format_notes import config_format_notes
            for note in config_format_notes(self.config):
                print(f"note: {note}", flush=True)
        return written

    def _save_failed_message(self, destination: str, error: Exception) -> str:
        folder, _ = newest_usable_backup(self.backup_root)
        if folder is None:
            where = ("no backup exists (backup.backup_before_save is off, or this save came before the first "
                     "backup)")
        else:
            where = (f"the trained weights are kept in the backup {folder}. To save from it, free space (or choose "
                     f"another output.destination) and run the same command with --config-value "
                     f"backup.continue_last_backup=true --config-value run_name={self.run_name}: a run resumed at its "
                     f"last step only saves")
        return f"saving {destination} failed: {error}; every earlier file is intact and {where}"
