"""What happens between optimizer steps: TensorBoard scalars, sample previews, backups and saves, each on its
own step / epoch / minute schedule."""
import time
from pathlib import Path

import torch

from modules.util.ranks import barrier, in_main_group, is_main, main_decides


class Every:
    """A schedule: every n steps, every n epochs, or every n minutes (0 disables each)."""

    def __init__(self, steps: int = 0, epochs: int = 0, minutes: float = 0.0):
        self.steps, self.epochs, self.minutes = steps, epochs, minutes
        self.last_time = time.monotonic()

    def due_after_step(self, step: int) -> bool:
        if self.steps and step % self.steps == 0:
            return True
        if self.minutes and time.monotonic() - self.last_time >= 60 * self.minutes:
            return True
        return False

    def due_after_epoch(self, epoch: int) -> bool:
        return bool(self.epochs) and (epoch + 1) % self.epochs == 0

    def mark(self) -> None:
        self.last_time = time.monotonic()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TrainingHooks:
    def __init__(self, trainer):
        self.trainer = trainer
        config = trainer.config
        self.backup_every = Every(config.backup.every_n_steps, config.backup.every_n_epochs,
                                  config.backup.every_n_minutes)
        self.save_every = Every(config.backup.save_every_n_steps, config.backup.save_every_n_epochs)
        self.sample_every = Every(config.sampling.every_n_steps, config.sampling.every_n_epochs,
                                  config.sampling.every_n_minutes)
        self.smoothed_loss = None
        self.last_loss = None   # the latest loss read back from the device
        self.unsent_losses: list[float] = []   # read back since the last on_update
        # several ranks: rank 0 alone writes TensorBoard and samples (with context parallel its group computes
        # them with it, over a sharded model every rank does, in step); the others wait for it at a barrier
        self.writer = None
        if config.tensorboard and is_main():
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(trainer.tensorboard_dir))
        self.sampling = bool(config.sampling.samples_file)
        self.sampler = None
        # a sharded (FSDP2) transformer's forward gathers each block from every rank: all of them run the sampler
        if self.sampling and (in_main_group() or trainer.parallel.forward_needs_every_rank):
            from modules.modelSampler.TrainingSampler import TrainingSampler
            self.sampler = TrainingSampler(trainer)
        self.visualizer = None
        e2v = trainer.data.e2v
        if e2v is not None and e2v.visualization.enabled and is_main():
            from modules.trainer.E2VVisualizer import E2VVisualizer
            self.visualizer = E2VVisualizer(trainer, e2v.visualization)

    def _sample(self) -> None:
        with self.trainer.parallel.previewing(self.trainer.model):   # expert parallel: both experts' adapters
            if self.sampler is not None:
                self.sampler.sample_all()
        barrier()

    def before_training(self) -> None:
        if self.sampling and self.trainer.config.sampling.sample_before_training:
            self._sample()

    def after_batch(self, batch: dict, prediction) -> None:
        if self.visualizer is not None and prediction is not None:
            self.visualizer.after_batch(batch, prediction)

    def log_loss(self, step: int, loss: float, grad_norm: float, expert_losses: list[float] | None = None) -> None:
        """A step's loss and gradient norm, once read back from the device (GenericTrainer.read_losses);
        `expert_losses`: expert parallel, (high-noise, low-noise) expert's loss of the step, whose mean is `loss`."""
        self.last_loss = loss
        self.unsent_losses.append(loss)
        self.smoothed_loss = loss if self.smoothed_loss is None else 0.95 * self.smoothed_loss + 0.05 * loss
        if self.writer is not None:
            self.writer.add_scalar("loss/step", loss, step)
            self.writer.add_scalar("loss/smoothed", self.smoothed_loss, step)
            self.writer.add_scalar("grad_norm", grad_norm, step)
            for side, part in zip(("high_noise", "low_noise"), expert_losses or []):
                self.writer.add_scalar(f"loss/step_{side}", part, step)

    def after_step(self, loss: float | None, step_time: float) -> None:
        """`loss`: the latest loss read back (None before the first read); the losses themselves are logged by
        log_loss, and on_update gets those read since its last call as "losses" (every step's, in order)."""
        trainer = self.trainer
        step = trainer.progress.global_step
        if self.writer is not None:
            for index, lr in enumerate(trainer.scheduler.get_last_lr()):
                self.writer.add_scalar(f"lr/group_{index}", lr, step)
            self.writer.add_scalar("time/step_seconds", step_time, step)
            self.writer.add_scalar("memory/peak_gib", peak_memory_bytes(trainer.device) / 2 ** 30, step)
        trainer.on_update({"step": step, "total_steps": trainer.total_steps, "epoch": trainer.progress.epoch,
                           "loss": loss, "losses": self.unsent_losses, "smoothed_loss": self.smoothed_loss,
                           "step_time": step_time})
        self.unsent_losses = []
        if self.sampling and self._due(self.sample_every, step) and step > trainer.config.sampling.skip_first:
            self._sample()
            self.sample_every.mark()
        if self._due(self.backup_every, step):
            trainer.backup()
            self.backup_every.mark()
        if self._due(self.save_every, step):
            self._intermediate_save(f"step-{step:08d}")

    @staticmethod
    def _due(every: Every, step: int) -> bool:
        """Step schedules agree on every rank by themselves; only a minute schedule reads a clock, and then rank 0's
        decides (a collective, so it is asked only then)."""
        due = every.due_after_step(step)
        return main_decides(due) if every.minutes else due

    def after_epoch(self, epoch: int) -> None:
        trainer = self.trainer
        if self.sampling and self.sample_every.due_after_epoch(epoch):
            self._sample()
        if self.backup_every.due_after_epoch(epoch):
            trainer.backup()
        if self.save_every.due_after_epoch(epoch):
            self._intermediate_save(f"epoch-{epoch:04d}")

    def _intermediate_save(self, name: str) -> None:
        """workspace/save/<name><the output's suffix>, keeping the newest backup.save_rolling_count of them."""
        from modules.trainer.workspace_files import prune_saves, save_folder
        config = self.trainer.config
        self.trainer.save_result(str(save_folder(config) / f"{name}{Path(config.output.destination).suffix}"))
        if is_main():
            prune_saves(save_folder(config), config.backup.save_rolling_count)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
