"""Runs a checkpoint x strength comparison and writes its files (docs/compare.md): per sample an MP4 grid
(`<index>-<prompt>-s<seed>.mp4`), a contact sheet of the middle frame (`.png`, lossless) and the layout (`.json`:
rows, columns, cell boxes, so a player or a test finds each cell; the steps, guidance and accelerator the cells ran
with). Used by scripts/compare.py and the GUI."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modules.modelSampler.LoraComparison import Cell, LoraComparison
from modules.modelSampler.compare_grid import GridLayout, compose
from modules.modelSampler.lora_checkpoints import find_checkpoints
from modules.modelSampler.WanModelSampler import SampleResult
from modules.util.config.SampleConfig import SampleConfig


@dataclass
class CompareOutput:
    index: int
    video: Path
    sheet: Path
    layout: Path


def run_title(result: SampleResult) -> str:
    """How a cell ran, for the grid's corner: "20 steps", "4 steps, accelerated"."""
    return f"{result.sample.steps} steps" + (", accelerated" if result.accelerator is not None else "")


def grid_layout(comparison: LoraComparison, sample: SampleResult) -> GridLayout:
    rows = [["base model", "no LoRA"]] + [[c.label, "step ?" if c.step is None else f"step {c.step}"]
                                        for c in comparison.checkpoints]
    columns = [f"strength {s:g}" for s in comparison.strengths]
    height, width = sample.frames.shape[1:3]
    return GridLayout.create(rows, columns, height, width, run_title(sample))


def cell_positions(comparison: LoraComparison, cell: Cell) -> list[tuple[int, int]]:
    """Where a cell's sample stands: the base model (no strength) under every strength, so each column compares
    the checkpoints at that strength with the base; a checkpoint's cell once."""
    if cell.checkpoint is None:
        return [(0, column) for column in range(len(comparison.strengths))]
    return [(1 + comparison.checkpoints.index(cell.checkpoint), comparison.strengths.index(cell.strength))]


def compare_checkpoints(model, lora_sources: list[str | Path], strengths: list[float], samples: list[SampleConfig],
                        output_dir: str | Path, device: torch.device,
                        on_cell: Callable[[int, Cell, SampleResult], None] | None = None,
                        on_step: Callable[[int, int], None] | None = None,
                        accelerator=None) -> list[CompareOutput]:
    """Samples every enabled sample for the base model and every checkpoint x strength of the LoRA sources (files,
    folders of files, backups) on the already-loaded `model`, and writes one grid per sample. `accelerator`
    (modules/modelSampler/accelerator.py): every cell runs with it, on its schedule, guidance 1."""
    from PIL import Image

    from modules.modelSampler.TrainingSampler import prompt_slug
    from modules.util.atomic import atomic_path
    from modules.util.video_frames import write_video

    comparison = LoraComparison(model, find_checkpoints(lora_sources), strengths, device, accelerator)
    samples = [s for s in samples if s.enabled]
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    outputs: list[CompareOutput] = []
    pending: dict[tuple[int, int], np.ndarray] = {}
    grid_cells = (1 + len(comparison.checkpoints)) * len(comparison.strengths)   # the base fills its whole row

    def collect(index: int, cell: Cell, result: SampleResult) -> None:
        if on_cell is not None:
            on_cell(index, cell, result)
        frames = result.frames_uint8()
        pending.update(dict.fromkeys(cell_positions(comparison, cell), frames))
        if len(pending) < grid_cells:
            return
        layout = grid_layout(comparison, result)
        grid = compose(layout, pending)
        stem = f"{index:03d}-{prompt_slug(samples[index].prompt)}-s{samples[index].seed}"
        video, sheet, layout_file = (output_dir / f"{stem}{suffix}" for suffix in (".mp4", ".png", ".json"))
        write_video(video, grid, result.fps)
        with atomic_path(sheet) as tmp:
            Image.fromarray(grid[len(grid) // 2]).save(tmp, format="PNG")
        with atomic_path(layout_file) as tmp:
            Path(tmp).write_text(json.dumps({"prompt": samples[index].prompt, "seed": samples[index].seed,
                                             "middle_frame": len(grid) // 2, "steps": result.sample.steps,
                                             "guidance": result.sample.guidance,
                                             "accelerator": result.accelerator, **layout.to_json()}, indent=1))
        outputs.append(CompareOutput(index, video, sheet, layout_file))
        pending.clear()

    comparison.run(samples, collect, on_step)
    return outputs
