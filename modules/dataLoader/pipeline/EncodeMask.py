"""The clip's loss mask at latent resolution (docs/masks.md), disk-cached beside the latents."""
import threading
from typing import Any

import cv2
import numpy as np
import torch

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames


def pool_to_latent(mask: torch.Tensor, spatial: int, temporal: int) -> torch.Tensor:
    """(F, H, W) weights in [0, 1] -> (1, T, H/spatial, W/spatial) with T = 1 + (F-1)/temporal: the mean over each
    latent cell's pixels. Wan's VAE keeps frame 0 alone in latent frame 0 and packs frames
    1 + temporal*(t-1) .. temporal*t into latent frame t (its causal 1 + 4k compression)."""
    frames, height, width = mask.shape
    if (frames - 1) % temporal or height % spatial or width % spatial:
        raise ValueError(f"a mask of {frames}x{height}x{width} does not fit the VAE's {temporal}x{spatial}x{spatial} "
                         f"compression")
    # (F, H, W) -> (F, h, w): the mean of each spatial x spatial cell
    pooled = torch.nn.functional.avg_pool2d(mask[:, None], spatial)[:, 0]
    # (F-1, h, w) -> (T-1, temporal, h, w) -> (T-1, h, w): the mean of each group of frames
    rest = pooled[1:].reshape(-1, temporal, *pooled.shape[1:]).mean(1)
    return torch.cat([pooled[:1], rest])[None]


class EncodeMask(PipelineModule):
    """'mask_weight' (1, T, h, w) float32: the item's mask ('mask', a path or None) read at the clip's frames,
    scaled and cropped exactly as ResizeCropVideo did the clip ('crop'), red channel / 255, pooled to the latent
    grid. Items without a mask get ones. Cached by the mask file's identity (path, size, modification time), the
    frames, the bucket and the crop, so editing a mask re-reads it without encoding the clip again."""

    def __init__(self, cache: DiskCache, spatial: int, temporal: int, name: str | None = None):
        super().__init__(name)
        self.cache, self.spatial, self.temporal = cache, spatial, temporal
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        return ["path", "mask", "media_info", "frame_indices", "resolution_bucket", "crop"]

    def produces(self) -> list[str]:
        return ["mask_weight"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        mask = ctx.get("mask", index)
        indices = list(ctx.get("frame_indices", index))
        height, width = ctx.get("resolution_bucket", index)
        frames = 1 + (len(indices) - 1) // self.temporal
        if mask is None:
            return {"mask_weight": torch.ones(1, frames, height // self.spatial, width // self.spatial)}
        crop = ctx.get("crop", index)
        key = cache_key("mask", file_identity(mask), indices, [height, width], crop, self.spatial, self.temporal)
        cached = self.cache.get(key, required=self.produces())
        if cached is None:
            try:
                weights = self._encode(mask, ctx.get("media_info", index), indices, crop, height, width)
            except UnreadableMediaError as error:
                # the clip's item is what cannot train: named by the clip, so the loader leaves it out
                raise UnreadableMediaError(ctx.get("path", index), f"its mask {error.path}: {error.reason}") from error
            cached = {"mask_weight": weights}
            with self.lock:
                self.encode_calls += 1
            self.cache.put(key, cached)
        return {"mask_weight": cached["mask_weight"]}

    def _encode(self, mask: str, clip_info, indices: list[int], crop: dict, height: int, width: int) -> torch.Tensor:
        info = probe_media(mask)
        if info.frame_count == 1:
            pixels = read_frames(mask, [0], info)
        elif info.frame_count == clip_info.frame_count:
            pixels = read_frames(mask, indices, info)
        else:
            raise UnreadableMediaError(mask, f"a mask video needs the clip's {clip_info.frame_count} frames; it has "
                                             f"{info.frame_count} (or use one image for every frame)")
        red = pixels[..., 0]  # (F, H, W): only the red channel carries the weight
        # scaled straight to the size the clip was scaled to (whatever the mask's own size), then cut at the clip's
        # crop corner: area averaging when shrinking, nearest when enlarging (no ringing around weight steps)
        scaled_h, scaled_w = crop["scaled_size"]
        if red.shape[1:] != (scaled_h, scaled_w):
            shrinking = scaled_h * scaled_w < red.shape[1] * red.shape[2]
            red = np.stack([cv2.resize(frame, (scaled_w, scaled_h),
                                       interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_NEAREST)
                            for frame in red])
        cropped = red[:, crop["top"]:crop["top"] + height, crop["left"]:crop["left"] + width]
        if crop["flip"]:
            cropped = cropped[:, :, ::-1]
        weights = torch.from_numpy(np.ascontiguousarray(cropped)).float().div_(255.0)
        if weights.shape[0] == 1 and len(indices) > 1:
            weights = weights.expand(len(indices), -1, -1)  # one mask image for every frame
        return pool_to_latent(weights.contiguous(), self.spatial, self.temporal)
