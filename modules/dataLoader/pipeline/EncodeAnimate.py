"""One Wan2.2-Animate training item, disk-cached: the companions read at the clip's own frame indices and cropped
as the clip was (ResizeCropVideo's 'crop'), then encoded by modules/model/animate_condition.py, the code the sampler
uses. Items:
- 'latents' (16, T + 1, h, w), raw as every item's: the reference image's latent, then the clip's (the target;
  frame 0 is condition);
- 'condition' (20, T + 1, h, w): the reference latents the transformer takes beside the noisy latents;
- 'pose_latents' (16, T, h, w), 'face_pixels' (3, F, S, S) in [-1, 1], 'image_embeds' (CLIP tokens);
- 'loss_mask' (1, T + 1, 1, 1): 0 on the reference frame and on the continuation frames' latents."""
import threading
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model import animate_condition as ac
from modules.util.video_frames import covering_size, frames_to_tensor, resize_and_crop
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames, read_image

ANIMATE_ENCODING_VERSION = 2   # raise when the encoding below changes: old cache entries are then not reused


def as_clip(frames: np.ndarray, crop: dict, height: int, width: int) -> np.ndarray:
    """A companion video's frames scaled to the size the clip was scaled to and cut where the clip was cut."""
    scaled_h, scaled_w = crop["scaled_size"]
    if covering_size(frames.shape[1], frames.shape[2], height, width) != (scaled_h, scaled_w):
        # another aspect than the clip's: stretched to the clip's scaled size first, so the crop lands alike
        interpolation = cv2.INTER_AREA if scaled_h * scaled_w < frames.shape[1] * frames.shape[2] else cv2.INTER_CUBIC
        frames = np.stack([cv2.resize(frame, (scaled_w, scaled_h), interpolation=interpolation) for frame in frames])
    return resize_and_crop(frames, height, width, crop["top"], crop["left"], crop["flip"])


class EncodeAnimate(PipelineModule):
    def __init__(self, model, cache: DiskCache, identity: str, mode: str, continuation_frames: int,
                 name: str | None = None):
        super().__init__(name)
        self.model, self.cache, self.identity = model, cache, identity
        self.mode, self.continuation_frames = mode, continuation_frames
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        return ["path", "frame_indices", "resolution_bucket", "video", "crop", "companions"]

    def produces(self) -> list[str]:
        return ["latents", "condition", "pose_latents", "face_pixels", "image_embeds", "loss_mask"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        companions = ctx.get("companions", index)
        crop = ctx.get("crop", index)
        key = cache_key("animate", file_identity(ctx.get("path", index)),
                        {k: file_identity(v) if v else None for k, v in companions.items()},
                        list(ctx.get("frame_indices", index)), list(ctx.get("resolution_bucket", index)), crop,
                        self.identity, self.mode, self.continuation_frames, ANIMATE_ENCODING_VERSION)
        cached = self.cache.get(key, required=self.produces())
        if cached is None:
            try:
                cached = self._encode(ctx.get("video", index), companions, list(ctx.get("frame_indices", index)),
                                      crop)
            except UnreadableMediaError as error:
                raise UnreadableMediaError(ctx.get("path", index), f"its companion {error.path}: {error.reason}") \
                    from error
            self.cache.put(key, cached)
        return {name: cached[name] for name in self.produces()}

    def companion_pixels(self, companions: dict, indices: list[int], crop: dict, height: int, width: int) -> dict:
        """The companions as the condition functions take them: (1, 3, F, ...) in [-1, 1] (mask (1, 1, F, H, W) in
        [0, 1]), the reference as a PIL image."""
        def frames(name: str) -> np.ndarray:
            path = companions[name]
            return read_frames(path, indices, probe_media(path))

        face_size = self.model.transformer.config.motion_encoder_size
        face = frames("face")
        out = {"reference": Image.fromarray(read_image(companions["reference"])),
               "pose": frames_to_tensor(as_clip(frames("pose"), crop, height, width))[None],
               "face": ac.video_pixels([Image.fromarray(f) for f in face], face_size, face_size)}
        if self.mode == "replace":
            out["background"] = frames_to_tensor(as_clip(frames("background"), crop, height, width))[None]
            mask = as_clip(frames("mask"), crop, height, width)[..., 0].astype(np.float32) / 255.0
            out["mask"] = torch.from_numpy(mask)[None, None]   # (1, 1, F, H, W), 1 = the character
        return out

    def _encode(self, video: torch.Tensor, companions: dict, indices: list[int], crop: dict) -> dict:
        model = self.model
        frames, height, width = video.shape[1], video.shape[2], video.shape[3]
        pixels = self.companion_pixels(companions, indices, crop, height, width)
        carry = self.continuation_frames
        with self.lock, torch.no_grad():
            self.encode_calls += 1
            vae = model.vae
            fitted = ac.reference_pixels(pixels["reference"], height, width)
            reference = ac.reference_image_latents(vae, fitted)
            previous = video[None, :, :carry] if carry else None
            segment = ac.segment_condition_latents(vae, frames, height, width, max(carry, 1), self.mode, previous,
                                                   pixels.get("background"), pixels.get("mask"),
                                                   continuing=carry > 0)
            target = ac.encode_normalised(vae, video[None])
            # raw latents, as every item's target (the setup normalises them)
            latents = ac.denormalise(vae, torch.cat([reference[:, 4:], target], dim=2))[0]
            loss_mask = torch.ones(1, latents.shape[1], 1, 1)
            loss_mask[:, :ac.condition_latent_frames(carry, carry > 0, vae.config.scale_factor_temporal)] = 0
            tokens = ac.clip_image_tokens(model.image_encoder, fitted)
            return {"latents": latents.float().cpu(),
                    "condition": torch.cat([reference, segment], dim=2)[0].float().cpu(),
                    "pose_latents": ac.pose_latents(vae, pixels["pose"])[0].float().cpu(),
                    "face_pixels": pixels["face"][0].float().cpu(), "image_embeds": tokens[0].float().cpu(),
                    "loss_mask": loss_mask}
