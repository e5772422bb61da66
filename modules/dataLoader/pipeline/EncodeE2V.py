import threading
from typing import Any

import torch

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.model.clip_pixels import CLIP_PREPROCESS
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.e2v_condition import (ELEMENT_PREPROCESS_VERSION, build_mini_video, clip_tokens,
                                         encode_condition_cache, make_e2v_condition,
                                         prepare_element_inputs, reference_latent_frames, reference_loss_mask,
                                         target_video_with_references)
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.video_io import read_image


class EncodeE2V(PipelineModule):
    """One E2V item, disk-cached: the target latents (reference frames prepended, or the clip as is), the condition
    latents for every slot subset frame_conditioning can keep (so a training step needs no VAE call), the CLIP
    tokens of the present elements in position order, and the loss mask over the reference latent frames. Element
    images are preprocessed to the clip's bucket exactly as the sampler does (modules/model/e2v_condition.py)."""

    def __init__(self, model, cache: DiskCache, identity: str, dataset: E2VDatasetConfig, name: str | None = None):
        super().__init__(name)
        self.model, self.cache, self.identity, self.dataset = model, cache, identity, dataset
        # everything in the dataset config that changes the encoding (not where the data lives, not visualization)
        self.settings = dataset.model_dump(mode="json", exclude={"data_root", "visualization"})
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        return ["path", "frame_indices", "resolution_bucket", "video", "crop", "elements"]

    def produces(self) -> list[str]:
        names = ["latents", "e2v_condition_cache", "loss_mask", "reference_images"]
        return names + (["image_embeds"] if self.dataset.uses_clip else [])

    def _cached_names(self) -> list[str]:
        """Tensors every entry holds (the condition tensors, `cond.*`, vary with the settings and are checked by the
        entry's checksum)."""
        return ["latents", "loss_mask", "reference_images"] + (["image_embeds"] if self.dataset.uses_clip else [])

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        elements = ctx.get("elements", index)
        parts = ["e2v", file_identity(ctx.get("path", index)), [file_identity(p) if p else None for p in elements],
                 list(ctx.get("frame_indices", index)), list(ctx.get("resolution_bucket", index)), self.identity,
                 self.settings, ELEMENT_PREPROCESS_VERSION, CLIP_PREPROCESS]
        key = cache_key(*parts)
        cached = self.cache.get(key, required=self._cached_names())
        if cached is None:
            cached = self._encode(ctx.get("video", index), elements)
            self.cache.put(key, cached)
        result = {"latents": cached["latents"], "loss_mask": cached["loss_mask"],
                  "reference_images": cached["reference_images"],
                  "e2v_condition_cache": {k.removeprefix("cond."): v for k, v in cached.items()
                                          if k.startswith("cond.")}}
        if self.dataset.uses_clip:
            result["image_embeds"] = cached["image_embeds"]
        return result

    def _encode(self, video: torch.Tensor, element_paths: tuple) -> dict[str, torch.Tensor]:
        dataset, model = self.dataset, self.model
        frames, height, width = video.shape[1], video.shape[2], video.shape[3]
        images = [read_image(path) if path else None for path in element_paths]
        tensors, clip_images = prepare_element_inputs(dataset, images, height, width)
        repeats = dataset.repeats()
        vae = dataset.processors.vae
        with self.lock, torch.no_grad():
            self.encode_calls += 1
            mini_video, pixel_mask = build_mini_video(tensors, repeats, frames, height=height, width=width)
            target = target_video_with_references(mini_video, pixel_mask, video, dataset.num_reference_frames,
                                                  dataset.reference_frames)
            latents = model.encode_video(target[None])[0].float().cpu()
            if dataset.uses_vae:
                condition = encode_condition_cache(model, tensors, repeats, frames, vae.combine,
                                                   vae.frame_conditioning, vae.frame_index)
            else:
                # the CLIP pathway alone: an empty condition (grey latents, mask 0) in every step
                empty = make_e2v_condition(model, [None] * len(tensors), repeats, frames, "before",
                                           concatenate_mask=False, height=height, width=width)
                condition = {"subset." + "0" * len(tensors): empty}
            result = {"latents": latents, "reference_images": mini_video[:, :dataset.num_reference_frames].float()}
            result.update({f"cond.{k}": v.float().cpu() for k, v in condition.items()})
            n_ref = dataset.num_reference_frames if dataset.reference_frames == "prepend" else 0
            result["loss_mask"] = reference_loss_mask(latents.shape[1], reference_latent_frames(n_ref),
                                                      dataset.reference_loss)[0]
            if dataset.uses_clip:
                result["image_embeds"] = clip_tokens(model, clip_images).float().cpu()
        return result
