"""E2V visualizations (the user's `visualization` section): every `frequency` steps, `latent_save` writes the named
tensors and `vae_decode` decodes the named latents and writes the listed frames as PNG, under `output_dir` with
`{run_id}` expanded (relative folders live in the workspace)."""
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from modules.util.video_frames import tensor_to_frames

log = logging.getLogger(__name__)

LATENT_NAMES = ("input_latents", "noisy_latents", "conditioned_latents", "predicted_latents")


class E2VVisualizer:
    def __init__(self, trainer, visualization):
        self.trainer = trainer
        self.config = visualization
        folder = Path(visualization.resolved_output_dir(trainer.run_name))
        self.folder = folder if folder.is_absolute() else Path(trainer.config.workspace_dir) / folder

    def _due(self) -> bool:
        # after_batch runs before the optimizer step is counted: this batch belongs to step global_step + 1
        return (self.trainer.progress.global_step + 1) % self.config.frequency == 0 \
            and self.trainer.progress.micro_step % self.trainer.config.optimizer.gradient_accumulation_steps == 0

    @staticmethod
    def tensors(batch: dict, prediction) -> dict[str, torch.Tensor]:
        named = {"input_latents": prediction.x0, "noisy_latents": prediction.noisy,
                 "predicted_latents": prediction.predicted_x0}
        if "condition" in batch:
            named["conditioned_latents"] = torch.cat([prediction.noisy, batch["condition"].to(prediction.noisy)], 1)
        if "reference_images" in batch:
            named["reference_images"] = batch["reference_images"]
        return {k: v.detach().float().cpu() for k, v in named.items()}

    def after_batch(self, batch: dict, prediction) -> None:
        if not self._due():
            return
        step = self.trainer.progress.global_step + 1
        folder = self.folder / f"step-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = self.tensors(batch, prediction)
        for processor in self.config.processors:
            chosen = {name: tensors[name] for name in processor.data if name in tensors}
            if processor.type == "latent_save":
                self._save_tensors(chosen, folder / f"tensors.{processor.format}", processor.format)
            else:
                self._decode(chosen, folder, processor.frames)

    @staticmethod
    def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, file_format: str) -> None:
        if file_format == "pt":
            # the user asked for torch's format by name (seed 002); every other file this project writes is
            # safetensors or JSON
            torch.save(tensors, path)
        else:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    @torch.no_grad()
    def _decode(self, tensors: dict[str, torch.Tensor], folder: Path, frames: list[int] | None) -> None:
        model = self.trainer.model
        for name, value in tensors.items():
            if name == "reference_images":
                video = value[0]                                     # (3, F, H, W) in [-1, 1]
            else:
                # conditioned_latents decode their first channels: the noisy latents of the model input
                latents = value[:1, :model.latent_channels]
                video = model.decode_latents(latents.to(next(model.vae.parameters()).device))[0].float().cpu()
            pixels = tensor_to_frames(video)
            count = len(pixels)
            for index in frames if frames is not None else range(count):
                if not -count <= index < count:
                    log.warning("visualization: frame %d is outside the %d decoded frames of %s", index, count, name)
                    continue
                Image.fromarray(np.ascontiguousarray(pixels[index])).save(folder / f"{name}_frame{index}.png")
