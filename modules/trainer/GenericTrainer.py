"""The training loop: cache, then per batch predict -> loss -> backward -> (every accumulation) optimizer step,
with samples, backups and saves between optimizer steps. Resume restores the exact data position and RNG."""
import hashlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from modules.trainer.backup_io import (TrainProgress, list_backups, prune_backups, read_backup, restore_rng_state,
                                       write_backup)
from modules.trainer.optimizers import EMA, create_lr_scheduler, create_optimizer
from modules.util.config.config_io import ConfigError, config_to_dict
from modules.util.config.TrainConfig import TrainConfig
from modules.util.config.validation import check_paths
from modules.util.registry import lookup

log = logging.getLogger(__name__)


class TrainingError(Exception):
    """A failure during training with a message for the user (the CLI exits 1)."""


def prepare_config(config: TrainConfig) -> list:
    """Everything that must hold before a model loads: demo assets created when asked, paths exist, the model is
    the configured type, the E2V datasets are valid (returned, resolved, for the trainer). Every problem found is
    reported in one ConfigError."""
    if config.demo_assets:
        from modules.util.demo_assets import ensure_demo_assets
        ensure_demo_assets(config)
    problems: list[str] = []
    try:
        check_paths(config)
    except ConfigError as error:
        problems += error.problems
    base = Path(config.model.base_model_name)
    spatial_unit = 16
    if base.is_dir():
        from modules.util.wan_detection import NotAWanModelError, detect_variant_from_folder
        try:
            variant = detect_variant_from_folder(base)
            spatial_unit = variant.spatial_unit
            if variant.model_type is not config.model_type:
                problems.append(f"model_type: {config.model_type} is set, but {str(base)!r} is a {variant} model "
                                f"({variant.model_type})")
        except NotAWanModelError as error:
            problems.append(f"model.base_model_name: {error}")
    datasets = []
    if config.e2v.enabled:
        from modules.util.config.E2VConfig import check_against_frames
        from modules.util.config.e2v_setup import apply_e2v_data_settings, resolve_e2v_datasets
        try:
            datasets = resolve_e2v_datasets(config, spatial_unit)
            apply_e2v_data_settings(config, datasets[0])
            for index, dataset in enumerate(datasets):
                try:
                    check_against_frames(dataset, min(config.data.frame_buckets), f"e2v datasets.{index}.")
                except ConfigError as error:
                    problems += error.problems
        except ConfigError as error:
            problems += error.problems
    if config.sampling.samples_file and Path(config.sampling.samples_file).is_file():
        from modules.util.sample_definitions import SampleDefinitionError, load_sample_definitions
        try:
            load_sample_definitions(config.sampling.samples_file)
        except SampleDefinitionError as error:
            problems.append(f"sampling.samples_file: {error}")
    if problems:
        raise ConfigError(problems)
    return datasets


def step_seed(seed: int, micro_step: int) -> int:
    """The noise and sigmas of a batch depend only on (seed, batch number): a resumed run draws the same ones."""
    digest = hashlib.sha256(f"{seed}:{micro_step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class GenericTrainer:
    def __init__(self, config: TrainConfig, on_update: Callable[[dict], None] | None = None,
                 e2v_datasets: list | None = None):
        """`e2v_datasets`: what prepare_config returned (resolved here when not given)."""
        self.config = config
        if e2v_datasets is None and config.e2v.enabled:
            from modules.util.config.e2v_setup import resolve_e2v_datasets
            base = Path(config.model.base_model_name)
            unit = 16
            if base.is_dir():
                from modules.util.wan_detection import detect_variant_from_folder
                unit = detect_variant_from_folder(base).spatial_unit
            e2v_datasets = resolve_e2v_datasets(config, unit)
        self.e2v_datasets = e2v_datasets or []
        self.on_update = on_update or (lambda _info: None)
        self.workspace = Path(config.workspace_dir)
        self.backup_root = self.workspace / "backup"
        self.stop_requested = threading.Event()
        self.step_losses: list[float] = []
        self.progress = TrainProgress()
        self.device = resolve_device(config.device)
        self.model = self.setup = self.data = None

    # ---- construction --------------------------------------------------------------------------------------

    def _load(self) -> None:
        from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
        import modules.modelLoader.WanModelLoader  # noqa: F401  (registers)
        import modules.modelSetup.WanEmbeddingSetup  # noqa: F401
        import modules.modelSetup.WanFineTuneSetup  # noqa: F401
        import modules.modelSetup.WanLoRASetup  # noqa: F401

        from modules.dataLoader.WanBaseDataLoader import DataError
        from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError
        from modules.util.wan_detection import NotAWanModelError, detect_variant_from_folder

        config = self.config
        base = Path(config.model.base_model_name)
        # the data is scanned before any model loads: no usable item is an error that costs nothing
        e2v_datasets = self.e2v_datasets
        try:
            self.data = WanBaseDataLoader(config, detect_variant_from_folder(base) if base.is_dir() else None,
                                          e2v_datasets)
            self.data.scan()
            self.model = lookup("model_loader", config.model_type, config.training_method)().load(config.model)
        except (DataError, ModelLoadError, NotAWanModelError) as error:
            raise TrainingError(str(error)) from None
        if e2v_datasets:
            from modules.model.e2v_model import prepare_e2v_model
            prepare_e2v_model(self.model, e2v_datasets[0])
        self.setup = lookup("model_setup", config.model_type, config.training_method)(config, self.model)
        self.setup.device = self.device
        self.data.attach_model(self.model, self.device)

    def cache_only(self) -> None:
        self._load()
        self.data.cache()

    # ---- training ------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stop_requested.set()

    def train(self) -> list[Path]:
        config = self.config
        torch.manual_seed(config.seed)
        self._load()
        self.data.cache()
        self.setup.setup_model()
        for name in self.setup.experts_in_training():
            getattr(self.model, name).to(self.device).train()
        if config.training_method.value == "EMBEDDING":
            self.model.text_encoder.to(self.device)

        parameters = self.setup.trainable_parameters()
        self.optimizer = create_optimizer(config.optimizer, parameters)
        batches_per_epoch = self.data.batches_per_epoch()
        accumulation = config.optimizer.gradient_accumulation_steps
        self.total_steps = config.max_steps or config.epochs * math.ceil(batches_per_epoch / accumulation)
        self.scheduler = create_lr_scheduler(config.optimizer, self.optimizer, self.total_steps)
        self.ema = EMA(parameters, config.optimizer.ema_decay) if config.optimizer.ema else None
        if config.backup.continue_last_backup:
            self._resume()

        from modules.trainer.TrainingHooks import TrainingHooks
        self.hooks = TrainingHooks(self)
        previous_handler = self._install_sigint()
        try:
            self.hooks.before_training()
            self._run_epochs(parameters, batches_per_epoch, accumulation)
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            self.hooks.close()
        if self.stop_requested.is_set():
            return []
        if self.ema is not None:
            self.ema.copy_to_parameters()
        return self.save_result(config.output.destination)

    def _run_epochs(self, parameters, batches_per_epoch: int, accumulation: int) -> None:
        from tqdm import tqdm
        config, progress = self.config, self.progress
        step_bar = tqdm(total=self.total_steps, initial=progress.global_step, desc="steps", unit="step")
        micro_losses: list[float] = []
        step_started = time.perf_counter()
        try:
            for epoch in range(progress.epoch, config.epochs):
                start = progress.epoch_batch if epoch == progress.epoch else 0
                progress.epoch, progress.epoch_batch = epoch, start
                for batch in self.data.batches(epoch, start):
                    generator = torch.Generator().manual_seed(step_seed(config.seed, progress.micro_step))
                    prediction = self.setup.predict(batch, generator)
                    loss = self.setup.calculate_loss(batch, prediction)
                    if not torch.isfinite(loss):
                        raise TrainingError(self._nan_message(loss))
                    (loss / accumulation).backward()
                    micro_losses.append(loss.item())
                    progress.micro_step += 1
                    progress.epoch_batch += 1
                    self.hooks.after_batch(batch, prediction)
                    if progress.micro_step % accumulation:
                        continue

                    grad_norm = self._optimizer_step(parameters)
                    progress.global_step += 1
                    step_loss = sum(micro_losses) / len(micro_losses)
                    micro_losses.clear()
                    self.step_losses.append(step_loss)
                    step_time = time.perf_counter() - step_started
                    step_started = time.perf_counter()
                    self.hooks.after_step(step_loss, grad_norm, step_time)
                    step_bar.set_postfix(epoch=epoch, loss=f"{step_loss:.4f}",
                                         lr=f"{self.scheduler.get_last_lr()[0]:.2e}", s_step=f"{step_time:.2f}")
                    step_bar.update()
                    if self.stop_requested.is_set():
                        self.backup()
                        return
                    if config.max_steps and progress.global_step >= config.max_steps:
                        return
                progress.epoch, progress.epoch_batch = epoch + 1, 0
                self.hooks.after_epoch(epoch)
        finally:
            step_bar.close()

    def _optimizer_step(self, parameters) -> float:
        clip = self.config.optimizer.clip_grad_norm
        grads = [p.grad for p in parameters if p.grad is not None]
        if clip:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, clip))
        else:
            grad_norm = float(torch.norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.setup.after_optimizer_step()
        if self.ema is not None:
            self.ema.update()
        return grad_norm

    def _nan_message(self, loss: torch.Tensor) -> str:
        backups = list_backups(self.backup_root)
        kept = f"the last good backup is {backups[-1]}" if backups else "no backup was written yet"
        return (f"the loss became {loss.item()} at step {self.progress.global_step + 1} (epoch "
                f"{self.progress.epoch}); training stopped and {kept}. Lower the learning rate or check the data.")

    # ---- SIGINT --------------------------------------------------------------------------------------------

    def _install_sigint(self):
        if threading.current_thread() is not threading.main_thread():
            return None  # the GUI worker thread stops through request_stop()

        def handle(_signum, _frame):
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            print("\nstopping after this step and writing a backup (Ctrl-C again to abort)", flush=True)
            self.stop_requested.set()

        return signal.signal(signal.SIGINT, handle)

    # ---- backup, resume, save ------------------------------------------------------------------------------

    def backup(self) -> Path:
        folder = self.backup_root / f"step-{self.progress.global_step:08d}"
        write_backup(folder, self.progress, self.setup.trainable_state_dict(), self.optimizer, self.scheduler,
                     self.ema, config_to_dict(self.config))
        prune_backups(self.backup_root, self.config.backup.rolling_count)
        log.info("backup written to %s", folder)
        return folder

    def _resume(self) -> None:
        backups = list_backups(self.backup_root)
        if not backups:
            log.warning("backup.continue_last_backup is set, but %s holds no backup: starting fresh",
                        self.backup_root)
            return
        state = read_backup(backups[-1])
        self.setup.load_trainable_state_dict(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        restore_rng_state(state["rng"])
        self.progress = state["progress"]
        print(f"resumed from {backups[-1]} at step {self.progress.global_step}", flush=True)

    def save_result(self, destination: str) -> list[Path]:
        output = self.config.output
        written = self.setup.save_result(destination, output.format, output.dtype.torch_dtype(),
                                         config_to_dict(self.config))
        for path in written:
            print(f"saved {path}", flush=True)
        return written
