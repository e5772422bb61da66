"""A clip's VACE control context (modules/model/vace_condition.py), disk-cached: the control video, the mask and the
reference images of the item, the control and mask read at the clip's own frames and cut exactly as the clip was
(ResizeCropVideo's 'crop'), so frame i of each is frame i of the target."""
import threading
from typing import Any

import cv2
import numpy as np
import torch

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.control_derive import derive_control
from modules.model.vace_condition import image_to_tensor, mask_from_frames, model_encoder, vace_context
from modules.util.video_frames import frames_to_tensor, resize_and_crop, tensor_to_frames
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames, read_image

VACE_PREPROCESS_VERSION = 2   # raise when the context computed from the same files changes
DERIVE_VERSION = 1            # raise when a derived control (control_derive.py) changes for the same frames


def _companion_frames(path: str, what: str, clip_info, indices: list[int], crop: dict, height: int,
                      width: int) -> np.ndarray:
    """The companion's frames at the clip's frame indices, scaled and cropped as the clip: uint8 (F, H, W, 3).
    A companion of another length or aspect is named, never padded or stretched."""
    info = probe_media(path)
    if what == "mask" and info.frame_count == 1 and clip_info.frame_count > 1:   # one mask image for every frame
        return np.repeat(_companion_frames(path, what, info, [0], crop, height, width), len(indices), axis=0)
    if info.frame_count != clip_info.frame_count:
        raise UnreadableMediaError(path, f"the {what} has {info.frame_count} frames, the clip "
                                         f"{clip_info.frame_count}; a {what} must have the clip's frames")
    if info.width * clip_info.height != info.height * clip_info.width:
        raise UnreadableMediaError(path, f"the {what} is {info.width}x{info.height}, the clip {clip_info.width}x"
                                         f"{clip_info.height}; a {what} must have the clip's aspect ratio")
    frames = read_frames(path, indices, info)
    scaled_h, scaled_w = crop["scaled_size"]
    if frames.shape[1:3] != (scaled_h, scaled_w):
        shrinking = scaled_h * scaled_w < frames.shape[1] * frames.shape[2]
        frames = np.stack([cv2.resize(frame, (scaled_w, scaled_h),
                                      interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC)
                           for frame in frames])
    return resize_and_crop(frames, height, width, crop["top"], crop["left"], crop["flip"])


class EncodeVACE(PipelineModule):
    """'vace_context' (96, n + T, h, w) float32 for n references and the clip's T latent frames. An item without a control gets a zero
    video (everything generated), or with `derive` ('canny' / 'gray': data.control.derive) one computed from its own
    frames; without a mask, or without a control, all ones; the mask is read as the sampler reads it
    (vace_condition.mask_from_frames: the red channel, grey values kept; white = generate). Cached by the
    identities of every file involved, the frames, the bucket, the crop, the derivation and the VAE."""

    def __init__(self, model, cache: DiskCache, identity: str, name: str | None = None, derive: str = "none"):
        super().__init__(name)
        self.model, self.cache, self.identity, self.derive = model, cache, identity, derive
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        derived = ["video"] if self.derive != "none" else []
        return ["path", "control", "mask", "references", "media_info", "frame_indices", "resolution_bucket", "crop",
                *derived]

    def produces(self) -> list[str]:
        return ["vace_context"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        control, mask, references = (ctx.get(name, index) for name in ("control", "mask", "references"))
        indices = list(ctx.get("frame_indices", index))
        height, width = ctx.get("resolution_bucket", index)
        crop = ctx.get("crop", index)
        derive = self.derive if not control and self.derive != "none" else None   # a clip's own control wins
        if control:
            control_identity = file_identity(control)
        else:   # a derived control is made from the clip itself
            control_identity = [derive, DERIVE_VERSION, file_identity(ctx.get("path", index))] if derive else None
        key = cache_key("vace", control_identity, file_identity(mask) if mask else None,
                        [file_identity(r) for r in references], indices, [height, width], crop, self.identity,
                        VACE_PREPROCESS_VERSION)
        cached = self.cache.get(key, required=["vace_context"])
        if cached is None:
            try:
                derived = derive_control(tensor_to_frames(ctx.get("video", index)), derive) if derive else None
                cached = {"vace_context": self._encode(control, mask, references, ctx.get("media_info", index),
                                                       indices, crop, height, width, derived)}
            except UnreadableMediaError as error:
                # the clip's item is what cannot train: named by the clip, so the loader leaves it out
                raise UnreadableMediaError(ctx.get("path", index), f"{error.path}: {error.reason}") from error
            self.cache.put(key, cached)
        return {"vace_context": cached["vace_context"]}

    def _encode(self, control, mask, references, clip_info, indices, crop, height, width,
                derived: np.ndarray | None = None) -> torch.Tensor:
        video = frames_to_tensor(_companion_frames(control, "control", clip_info, indices, crop, height, width)) \
            if control else None if derived is None else frames_to_tensor(derived)
        pixel_mask = None
        if mask:
            pixel_mask = mask_from_frames(_companion_frames(mask, "mask", clip_info, indices, crop, height, width))
        images = [image_to_tensor(read_image(path)) for path in references]
        with self.lock, torch.no_grad():
            self.encode_calls += 1
            context = vace_context(model_encoder(self.model), video, pixel_mask, images, num_frames=len(indices),
                                   height=height, width=width)
        return context.float().cpu()
