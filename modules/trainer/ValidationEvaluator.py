"""The validation loss (docs/validation.md): the flow-matching loss of the held-out items, with no gradient, at
fixed sigmas and with fixed noise per item and sigma, so two evaluations differ only by the weights.

Sigmas: `validation.timesteps` quantiles ((k + 0.5) / K) of the distribution the run trains with, restricted to its
min / max sigma and to the trained expert's range (Wan 2.2 A14B: high noise at and above the boundary, low noise
below; both experts: the whole range, each sigma evaluated by its own expert). Noise: item i at sigma k draws from a
generator seeded by (seed, k, i), whatever batch or rank the item falls in.

Several ranks: the batches (cut alike on every world size, no shuffle) are dealt out in turn; each rank writes its
items' losses into a zero table and the tables are summed (an all-reduce of exact zeros elsewhere), so every rank
holds the single-process table bit for bit and computes the same mean. A sharded (FSDP2) model needs every rank in
every forward pass: ranks short of a batch then run a copy whose losses are not kept.
"""
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.modelSetup.BaseWanSetup import Prediction
from modules.modelSetup.timestep_sampling import sample_sigmas
from modules.trainer.backup_io import verify_backup
from modules.util.atomic import atomic_write_text
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.ranks import broadcast_json, context_parallel, data_rank_and_size, is_main, rank_and_world

log = logging.getLogger(__name__)

BEST_FOLDER = "best"            # <workspace>/backup/<run>/best: the backup with the lowest validation loss
RESULT_FILE = "validation.json"  # in that backup: {"step", "loss", "per_sigma"}
QUANTILE_DRAWS = 1 << 16         # draws of the training distribution the sigmas are the quantiles of


@dataclass
class ValidationResult:
    step: int
    loss: float
    per_sigma: dict[str, float]  # "0.123" (the sigma, 3 decimals) -> the mean loss there


def validation_sigmas(timestep_config, count: int, low: float, high: float, include_high: bool) -> list[float]:
    """`count` quantiles of the training sigma distribution on [low, high] (fixed draws: the same on every run)."""
    draws = sample_sigmas(timestep_config, QUANTILE_DRAWS, torch.Generator().manual_seed(0), low=low, high=high,
                          include_high=include_high).double()
    levels = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    return [float(s) for s in torch.quantile(draws, levels)]


def sigma_tags(sigmas: list[float]) -> list[str]:
    """Each sigma as text for its TensorBoard tag: three decimals, more where three would not tell two apart."""
    for decimals in range(3, 10):
        tags = [f"{s:.{decimals}f}" for s in sigmas]
        if len(set(tags)) == len(tags):
            return tags
    return [repr(s) for s in sigmas]


class ValidationEvaluator:
    def __init__(self, trainer):
        self.trainer = trainer
        config = trainer.config
        self.settings = config.validation
        batch_size = self.settings.batch_size or config.batch_size
        self.pipeline = trainer.data.validation_pipeline(batch_size)
        self.batcher = self.pipeline.modules[-1]
        self.batch_count = len(self.pipeline)
        self.item_count = sum(len(self.batcher.upstream_indices(b)) for b in range(self.batch_count))
        self.sigmas = validation_sigmas(config.timestep, self.settings.timesteps, *self._sigma_range())
        self.tags = sigma_tags(self.sigmas)
        # every value of this run, also those before a resume: <workspace>/validation/<run>.json
        self.history_file = trainer.workspace / "validation" / f"{trainer.run_name}.json"
        self.history: list[ValidationResult] = []
        self.best: ValidationResult | None = None
        if config.backup.continue_last_backup:
            # rank 0's files for every rank (other machines may not share the workspace): the ranks must decide alike
            # when to evaluate and when to back up the best, both collectives
            saved = broadcast_json([[asdict(r) for r in self._saved_history()], self._saved_best()]
                                   if is_main() else None)
            self.history = [ValidationResult(**row) for row in saved[0]]
            self.best = ValidationResult(**saved[1]) if saved[1] else None
        self.best_folder = trainer.backup_root / BEST_FOLDER

    @classmethod
    def create(cls, trainer) -> "ValidationEvaluator | None":
        """None when the run holds no item out (no concept marked `validation`, no `data.validation_split`)."""
        return cls(trainer) if trainer.data.validation_records else None

    def _sigma_range(self) -> tuple[float, float, bool]:
        setup, model = self.trainer.setup, self.trainer.model
        experts = setup.experts_in_training()
        if model.boundary_ratio is None or not model.variant.has_two_experts or len(experts) == 2:
            return 0.0, 1.0, True
        boundary = model.boundary_ratio
        return (boundary, 1.0, True) if experts == ["transformer"] else (0.0, boundary, False)

    def _saved_best(self) -> dict | None:
        """The best so far of the run a resume continues (its `best` backup), so a worse value cannot replace it."""
        folder = self.trainer.backup_root / BEST_FOLDER
        if not (folder / RESULT_FILE).is_file() or verify_backup(folder):
            return None
        return json.loads((folder / RESULT_FILE).read_text())

    def _saved_history(self) -> list[ValidationResult]:
        """The values the resumed run logged up to the step it resumes at (later ones are evaluated again)."""
        if not self.history_file.is_file():
            return []
        try:
            rows = json.loads(self.history_file.read_text(encoding="utf-8"))
            saved = [ValidationResult(**row) for row in rows]
        except (OSError, ValueError, TypeError) as error:
            log.warning("%s cannot be read (%s); the validation values before this resume are left out of the "
                        "end report (TensorBoard has them)", self.history_file, error)
            return []
        return [r for r in saved if r.step <= self.trainer.progress.global_step]

    # ---- the schedule ------------------------------------------------------------------------------------------

    def before_training(self) -> None:
        if self.settings.before_training and not self.history and self.trainer.progress.global_step == 0:
            self.run()

    def after_step(self) -> None:
        every = self.settings.every_n_steps
        if every and self.trainer.progress.global_step % every == 0:
            self.run()

    def at_end(self) -> None:
        if not self.history or self.history[-1].step != self.trainer.progress.global_step:
            self.run()

    # ---- one evaluation ----------------------------------------------------------------------------------------

    def run(self) -> ValidationResult:
        """Evaluates, logs to TensorBoard and the GUI, and keeps the best backup when asked."""
        trainer = self.trainer
        started = time.perf_counter()
        result = self.evaluate()
        self.history.append(result)
        if is_main():
            atomic_write_text(self.history_file, json.dumps([asdict(r) for r in self.history], indent=1))
        writer = trainer.hooks.writer
        if writer is not None:
            writer.add_scalar("validation/loss", result.loss, result.step)
            for tag, value in result.per_sigma.items():
                writer.add_scalar(f"validation/loss_sigma_{tag}", value, result.step)
        trainer.on_update({"validation_loss": result.loss, "step": result.step,
                           "validation_per_sigma": result.per_sigma})
        lowest = self.lowest() is result
        # `best` is the lowest trained step: before the first step the weights are the base model's (and a sharded
        # optimizer would have to make up its state to be backed up)
        improved = result.step > 0 and (self.best is None or result.loss < self.best.loss)
        if improved:
            self.best = result
        if is_main():
            tqdm.write(f"validation loss at step {result.step}: {result.loss:.6f} ({self.item_count} items x "
                       f"{len(self.sigmas)} sigmas, {time.perf_counter() - started:.1f} s)"
                       + (" - lowest so far" if lowest else ""))
        if improved and self.settings.keep_best:
            trainer.backup(self.best_folder, extra_json={RESULT_FILE: asdict(result)})
        return result

    @torch.no_grad()
    def evaluate(self) -> ValidationResult:
        trainer = self.trainer
        setup, device = trainer.setup, trainer.device
        # the data-parallel groups share the batches out; the ranks of a context-parallel group run each of their
        # group's batches together and the first of them keeps its losses
        rank, world = data_rank_and_size()
        keeps = rank_and_world()[0] % context_parallel() == 0
        losses = torch.zeros(self.item_count, len(self.sigmas), dtype=torch.float64)
        parts = [getattr(trainer.model, name) for name in setup.experts_in_training()]
        if trainer.config.training_method is TrainingMethod.EMBEDDING:
            parts.append(trainer.model.text_encoder)  # it runs in every step: its dropout too
        # every module's own mode: a part in training mode may hold submodules kept in eval mode on purpose
        modes = [(module, module.training) for part in parts for module in part.modules()]
        for part in parts:
            part.eval()  # no dropout: the same weights give the same value
        slots = math.ceil(self.batch_count / world)
        bar = tqdm(total=slots * len(self.sigmas), desc="validation", unit="pass", leave=False, disable=not is_main())
        try:
            for slot in range(slots):
                index = slot * world + rank
                if index >= self.batch_count and not trainer.parallel.forward_needs_every_rank:
                    break
                batch = self.pipeline.get_item(index % self.batch_count)
                items = self.batcher.upstream_indices(index % self.batch_count)
                batch["item_index"] = torch.tensor(items, dtype=torch.long)  # the noise follows the item
                for k, sigma in enumerate(self.sigmas):
                    own = trainer.parallel.own_expert   # expert parallel: each half evaluates its expert's sigmas
                    if own is not None and setup.expert_for_sigma(sigma) != own:
                        bar.update()
                        continue
                    generator = torch.Generator().manual_seed(derive_seed(trainer.config.seed, k, None, "validation"))
                    sigmas = torch.full((len(items),), sigma, dtype=torch.float32)
                    prediction = setup.predict(batch, generator, sigmas=sigmas)
                    if index < self.batch_count and keeps:
                        losses[items, k] = torch.stack(self._item_losses(batch, prediction)).double().cpu()
                    bar.update()
        finally:
            bar.close()
            for module, mode in modes:
                module.training = mode
        if rank_and_world()[1] > 1:
            # every other rank's entries are exact zeros: the sum is each rank's table, bit for bit
            reduced = losses.to(device)
            dist.all_reduce(reduced)
            losses = reduced.cpu()
        per_sigma = losses.mean(0)
        return ValidationResult(step=trainer.progress.global_step, loss=float(losses.mean()),
                                per_sigma={tag: float(v) for tag, v in zip(self.tags, per_sigma)})

    def _item_losses(self, batch: dict, prediction: Prediction) -> list[torch.Tensor]:
        """Each item's loss, by setup.calculate_loss on the item alone (its mask and its weighting as in training,
        without the concept's loss weight: the validation loss measures the model, not the emphasis)."""
        count = prediction.predicted.shape[0]

        def one(value, i):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == count:
                return value[i:i + 1]
            if isinstance(value, list) and len(value) == count:
                return value[i:i + 1]
            return value

        losses = []
        for i in range(count):
            item_batch = {key: one(value, i) for key, value in batch.items() if key != "loss_weight"}
            item_prediction = Prediction(**{f.name: one(getattr(prediction, f.name), i) for f in fields(Prediction)})
            losses.append(self.trainer.setup.calculate_loss(item_batch, item_prediction).detach().float())
        return losses

    # ---- reports -----------------------------------------------------------------------------------------------

    def plan_line(self) -> str:
        every = self.settings.every_n_steps
        when = (["before training"] if self.settings.before_training else []) + \
            ([f"every {every} steps"] if every else []) + ["at the end"]
        best = f"; the lowest kept in {self.best_folder}" if self.settings.keep_best else ""
        return (f"  validation: {self.item_count} held-out items in {self.batch_count} batches at sigmas "
                f"{', '.join(self.tags)} ({', '.join(when)}{best})")

    def lowest(self) -> ValidationResult | None:
        candidates = self.history + ([self.best] if self.best is not None else [])
        return min(candidates, key=lambda r: (r.loss, r.step)) if candidates else None

    def end_line(self, written: list[Path]) -> str:
        """'lowest validation loss at step N: <the backup or save that holds step N>'."""
        best = self.lowest()
        if best is None:
            return "  validation: not evaluated"
        trainer = self.trainer
        step = best.step
        if step == 0:
            line = f"  lowest validation loss at step 0: {best.loss:.6f}, before training (no trained step was lower)"
            if self.settings.keep_best and self.best is not None:
                line += f"; the lowest trained step, {self.best.step} ({self.best.loss:.6f}), is in backup " \
                        f"{self.best_folder}"
            return line
        if self.settings.keep_best and self.best is not None and self.best.step == step:
            where = f"backup {self.best_folder}"
        elif (trainer.backup_root / f"step-{step:08d}").is_dir():
            where = f"backup {trainer.backup_root / f'step-{step:08d}'}"
        elif step == trainer.progress.global_step and written:
            where = f"save {', '.join(str(p) for p in written)}"
        else:
            from modules.trainer.workspace_files import save_folder
            saves = sorted(save_folder(trainer.config).glob(f"step-{step:08d}*"))
            where = f"save {saves[0]}" if saves else \
                "no backup or save holds that step (validation.keep_best: true keeps it)"
        return f"  lowest validation loss at step {step}: {best.loss:.6f}; {where}"
