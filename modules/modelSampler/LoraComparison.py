"""Checkpoint x strength comparison (docs/compare.md): the same samples for every LoRA checkpoint at every
strength, and for the base model without LoRA, with the base model loaded once.

Each cell merges its LoRA into the loaded weights exactly as scripts/sample.py does (`merge_lora` on the file's
weights matched to the model's modules, at the cell's strength) after the weights it touches were put back to the
base model's: their base values are kept on the CPU (only the modules some checkpoint adapts), so a cell equals a
sample.py run with that file and strength bit for bit, and no cell depends on the one before."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from modules.model.WanModel import WanModel
from modules.model.e2v_lora import read_e2v_lora
from modules.util.expert_metadata import expert_problem
from modules.modelSampler.WanModelSampler import SampleError, SampleResult, WanModelSampler
from modules.modelSampler.lora_checkpoints import Checkpoint, backup_lora_weights
from modules.util.config.SampleConfig import SampleConfig
from modules.util.lora.apply import merge_lora
from modules.util.lora.formats import LoraMatchError, LoraWeights, load_lora_file, match_to_model


@dataclass
class Cell:
    checkpoint: Checkpoint | None   # None: the base model without LoRA
    strength: float                 # 0 for the base model

    @property
    def title(self) -> str:
        return "base model (no LoRA)" if self.checkpoint is None else self.checkpoint.title


class LoraComparison:
    def __init__(self, model: WanModel, checkpoints: list[Checkpoint], strengths: list[float],
                 device: torch.device, accelerator=None):
        if not strengths:
            raise ValueError("at least one strength is needed")
        self.model, self.checkpoints, self.strengths = model, checkpoints, list(strengths)
        # an accelerator acts through hooks and restored deltas around each sample, on top of the merged cell
        self.sampler = WanModelSampler(model, device=device, accelerator=accelerator)
        self.weights = [self._read(c) for c in checkpoints]   # per checkpoint: expert -> LoraWeights
        touched: dict[str, set[str]] = {}
        for weights in self.weights:
            for expert, modules in weights.items():
                touched.setdefault(expert, set()).update(modules)
        self._base = {expert: self._snapshot(expert, names) for expert, names in touched.items()}

    def _read(self, checkpoint: Checkpoint) -> dict[str, LoraWeights]:
        """expert -> the checkpoint's weights matched to that expert's module names (sample.py's reading)."""
        if checkpoint.backup is not None:
            raw = backup_lora_weights(checkpoint.backup)
        else:
            from modules.modelSampler.sampling_io import _expert_files
            raw = {}
            for file in checkpoint.files:
                for expert, path in _expert_files(self.model, file).items():
                    # A14B: a file recorded for the other expert is refused, as sample.py refuses it
                    problem = expert_problem(path, expert, "the LoRA") if self.model.variant.has_two_experts else None
                    if problem:
                        raise SampleError(problem)
                    if read_e2v_lora(path)[1]:
                        raise SampleError(f"{path}: an Elements-to-Video LoRA (it expands the model): compare it "
                                          f"with sample --lora, one strength at a time")
                    raw[expert] = load_lora_file(path)[0]
        matched = {}
        for expert, weights in raw.items():
            transformer = getattr(self.model, expert, None)
            if transformer is None:
                raise SampleError(f"{checkpoint.source}: adapts {expert}, which this model does not have")
            try:
                matched[expert] = match_to_model(weights, [name for name, _ in transformer.named_modules()])
            except LoraMatchError as error:
                raise SampleError(f"{checkpoint.source}: {error}") from None
        return matched

    def _snapshot(self, expert: str, names: set[str]) -> dict[str, torch.Tensor]:
        modules = dict(getattr(self.model, expert).named_modules())
        return {name: modules[name].weight.detach().to("cpu", copy=True) for name in sorted(names)}

    def restore_base(self) -> None:
        """Every adapted weight back to the base model's value (exact copies)."""
        for expert, saved in self._base.items():
            modules = dict(getattr(self.model, expert).named_modules())
            with torch.no_grad():
                for name, weight in saved.items():
                    modules[name].weight.copy_(weight)

    def cells(self) -> list[Cell]:
        """The base model first, then every checkpoint at every strength, in the order given."""
        return [Cell(None, 0.0)] + [Cell(c, s) for c in self.checkpoints for s in self.strengths]

    def sample_cell(self, cell: Cell, sample: SampleConfig,
                    on_step: Callable[[int, int], None] | None = None) -> SampleResult:
        self.restore_base()
        if cell.checkpoint is not None:
            weights = self.weights[self.checkpoints.index(cell.checkpoint)]
            with torch.no_grad():
                for expert, modules in weights.items():
                    merge_lora(getattr(self.model, expert), modules, cell.strength)
        try:
            return self.sampler.sample(sample, on_step=on_step)
        finally:
            self.restore_base()

    def run(self, samples: list[SampleConfig], on_cell: Callable[[int, Cell, SampleResult], None],
            on_step: Callable[[int, int], None] | None = None) -> None:
        """Samples every cell of every sample, sample by sample (so each sample's grid can be written as soon as it
        is complete), calling `on_cell(sample index, cell, result)`. Each cell merges its LoRA anew: merging is
        quick next to sampling."""
        for sample in samples:
            self.sampler.resolve(sample, log=False)  # a bad sample fails before any sampling
        for index, sample in enumerate(samples):
            for cell in self.cells():
                on_cell(index, cell, self.sample_cell(cell, sample, on_step))
