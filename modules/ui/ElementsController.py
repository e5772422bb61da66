"""The elements tab (E2V): the elements table and processors of the first inline dataset (`e2v.datasets.0`, the
nested form), import / export of the user's JSON forms, and the drawing of the mini-video and of the latent mask.
Imports no toolkit.

The drawing is made by the functions the data pipeline uses (modules/model/e2v_condition.py and
WanModel.fold_frame_mask), so it cannot disagree with training: combine 'before' folds the pixel-frame mask as
Wan I2V does; combine 'after' puts slot k on latent frame k (`assemble_after_condition`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.ui.UIState import UIState
from modules.util.atomic import atomic_write_text
from modules.util.config.config_io import ConfigError
from modules.util.config.E2VConfig import VAE_TEMPORAL_STRIDE, E2VDatasetConfig, load_e2v_dataset_configs

DATASET = "e2v.datasets.0"
ELEMENT_COLUMNS = ("name", "suffixes", "required", "vae.position", "vae.repeat", "vae.preprocess", "clip.preprocess")


class _StrideOnly:
    """The mask functions read only the VAE's temporal stride from the model; no weights are needed to draw."""
    vae_temporal_stride = VAE_TEMPORAL_STRIDE


@dataclass
class E2VDrawing:
    num_frames: int
    slot_of_frame: list[int | None]   # per pixel frame: the slot whose element fills it, None for grey
    pixel_mask: list[float]           # per pixel frame
    latent_mask: list[list[float]]    # [stride][latent frame]: the mask channels concatenated to the latents
    names: list[str]                  # per slot
    kept: list[bool]                  # per slot, after frame conditioning


def new_element(position: int) -> dict:
    return {"name": f"element_{position}", "suffixes": [f"_element{position}.png"], "required": position == 0,
            "vae": {"repeat": 1 if position == 0 else VAE_TEMPORAL_STRIDE, "position": position},
            "clip": {"preprocess": None}}


def new_dataset() -> dict:
    """A one-element dataset in the nested form with every field written out (so each has its widget)."""
    dataset = E2VDatasetConfig.model_validate(
        {"data_root": "unset", "target_resolution": [480, 832], "elements": [new_element(0)],
         "processors": {"vae": {}}}).model_dump(mode="json")
    dataset["data_root"] = ""   # the user's to fill: marked as required, never a made-up path stored as a value
    return dataset


def latent_mask_for(kept: list[bool], repeats: list[int], num_frames: int, combine: str) -> torch.Tensor:
    """(stride, T): the mask channels the pipeline concatenates for these kept slots (h = w = 1)."""
    from modules.model.e2v_condition import assemble_after_condition, pixel_frame_mask
    from modules.model.WanModel import WanModel

    model = _StrideOnly()
    if combine == "after":
        unit = torch.zeros(1, 1, 1, 1, 1)
        slot_latents = {k: unit for k, keep in enumerate(kept) if keep}
        condition = assemble_after_condition(model, slot_latents, unit, num_frames, concatenate_mask=True)
        return condition[0, :VAE_TEMPORAL_STRIDE, :, 0, 0]
    pixel = pixel_frame_mask(kept, repeats, num_frames)
    return WanModel.fold_frame_mask(model, pixel.unsqueeze(0), 1, 1)[0, :, :, 0, 0]


class ElementsController:
    def __init__(self, state: UIState):
        self.state = state
        self.random_seed = 0

    # ---- the dataset being edited -------------------------------------------------------------------------------

    def has_dataset(self) -> bool:
        return bool(self.state.get("e2v.datasets"))

    def ensure_dataset(self) -> None:
        if not self.has_dataset():
            self.state.set("e2v.datasets", [new_dataset()])

    def elements(self) -> list[dict]:
        return list(self.state.get(f"{DATASET}.elements") or [])

    def add_element(self) -> int:
        self.ensure_dataset()
        return self.state.list_append(f"{DATASET}.elements", new_element(len(self.elements())))

    def remove_element(self, index: int) -> None:
        self.state.list_remove(f"{DATASET}.elements", index)

    def dataset_config(self, for_drawing: bool = False) -> E2VDatasetConfig:
        """The first dataset, validated as training validates it (ConfigError naming the fields otherwise). The
        drawing does not need the data folder: `for_drawing` draws a dataset whose data_root is still empty."""
        if self.state.get("e2v.dataset_config"):
            return load_e2v_dataset_configs(self.state.get("e2v.dataset_config"))[0]
        datasets = self.state.get("e2v.datasets") or []
        if for_drawing and datasets and not datasets[0].get("data_root"):
            datasets = [dict(datasets[0], data_root="(not set yet)")] + list(datasets[1:])
        return load_e2v_dataset_configs({"datasets": datasets})[0]

    # ---- import / export ----------------------------------------------------------------------------------------

    def import_file(self, path: str | Path) -> int:
        """A dataset config in any of the user's forms (nested seeds 000 / 001, flat seed 002, wrapped or not):
        validated, then held inline in the nested form. Returns the number of datasets."""
        datasets = load_e2v_dataset_configs(path)
        self.state.set("e2v.dataset_config", "")
        self.state.set("e2v.datasets", [dataset.model_dump(mode="json") for dataset in datasets])
        return len(datasets)

    def export_file(self, path: str | Path) -> None:
        """Writes {"datasets": [...]} in the nested form, readable by --dataset_configs and by import."""
        datasets = [d.model_dump(mode="json") for d in load_e2v_dataset_configs(
            {"datasets": self.state.get("e2v.datasets") or []})]
        atomic_write_text(path, json.dumps({"datasets": datasets}, indent=2) + "\n")

    # ---- the drawing --------------------------------------------------------------------------------------------

    def frame_choices(self) -> list[int]:
        return [int(f) for f in self.state.get("data.frame_buckets") or [] if isinstance(f, int)]

    def drawing(self, num_frames: int, present: list[bool] | None = None) -> E2VDrawing:
        """The mini-video slots and the latent mask for `num_frames` frames, with `present[k]` saying whether
        slot k's element exists in the item (default: all). Frame conditioning and combine come from the dataset
        and the e2v overrides, as training resolves them. ConfigError / ValueError when the settings do not fit."""
        from modules.model.e2v_condition import apply_frame_conditioning, pixel_frame_mask, slot_starts

        dataset = self.dataset_config(for_drawing=True)
        vae = dataset.processors.vae
        mode = self.state.get("e2v.frame_conditioning") or vae.frame_conditioning
        index = self.state.get("e2v.frame_index")
        index = vae.frame_index if index is None else index
        elements = dataset.elements_in_position_order()
        repeats = dataset.repeats()
        present = present if present is not None else [True] * len(elements)
        generator = torch.Generator().manual_seed(self.random_seed)
        kept = apply_frame_conditioning(present, mode, index, generator)
        pixel = pixel_frame_mask(kept, repeats, num_frames)
        latent = latent_mask_for(kept, repeats, num_frames, vae.combine)
        slot_of_frame: list[int | None] = [None] * num_frames
        for slot, (start, repeat) in enumerate(zip(slot_starts(repeats), repeats)):
            if kept[slot]:
                for frame in range(start, start + repeat):
                    slot_of_frame[frame] = slot
        return E2VDrawing(num_frames, slot_of_frame, pixel.tolist(), latent.tolist(),
                          [element.name for element in elements], kept)

    def redraw_random(self) -> None:
        self.random_seed += 1

    def enabled(self) -> bool:
        return bool(self.state.get("e2v.dataset_config") or self.state.get("e2v.datasets"))

    def problems(self) -> list[str]:
        """The dataset checks training runs, worded with the config's dotted fields (e2v.datasets.0....)."""
        if not self.enabled():
            return []
        try:
            self.dataset_config()
        except ConfigError as error:
            prefix = "e2v.dataset_config: " if self.state.get("e2v.dataset_config") else "e2v."
            return [prefix + problem for problem in error.problems]
        return []
