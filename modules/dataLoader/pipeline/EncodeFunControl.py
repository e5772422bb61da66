"""A clip's Wan-Fun Control condition (modules/model/fun_condition.py), disk-cached: the clip's control video (its
`<name>_control` companion, read at the clip's frames and cut as the clip, as EncodeVACE reads it; or derived from
the clip with data.control.derive) and the clip's first frame as the start image, as VideoX-Fun trains its control
models (`train_control_lora.py`: the reference frame is the clip's frame 0 in most steps, in latent frame 0 of the
start-image channels; for Wan2.2-Fun Control A14B frame 0 kept through the inpaint channels)."""
from typing import Any

import torch

from modules.dataLoader.DiskCache import cache_key, file_identity
from modules.dataLoader.pipeline.EncodeVACE import DERIVE_VERSION, EncodeVACE, _companion_frames
from modules.model.control_derive import derive_control
from modules.model.fun_condition import first_frame_inputs, fun_control_a14b_condition, fun_control_condition
from modules.model.vace_condition import model_encoder
from modules.util.video_frames import frames_to_tensor, tensor_to_frames
from modules.util.video_io import UnreadableMediaError

FUN_PREPROCESS_VERSION = 1   # raise when the condition computed from the same files changes


class EncodeFunControl(EncodeVACE):
    """'condition' (32 or 36, T, h, w) float32: the channels a Wan-Fun Control transformer takes after the noise. An
    item without a control (and no derivation) gets zero control latents, as VideoX-Fun's pipeline does. Reads its
    control as EncodeVACE does (same constructor: the model, the cache, the VAE identity, the derivation)."""

    def needs(self) -> list[str]:
        return ["path", "control", "media_info", "frame_indices", "resolution_bucket", "crop", "video"]

    def produces(self) -> list[str]:
        return ["condition"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        control = ctx.get("control", index)
        indices = list(ctx.get("frame_indices", index))
        height, width = ctx.get("resolution_bucket", index)
        crop = ctx.get("crop", index)
        derive = self.derive if not control and self.derive != "none" else None
        control_identity = file_identity(control) if control else [derive, DERIVE_VERSION] if derive else None
        key = cache_key("fun_control", str(self.model.variant), control_identity,
                        file_identity(ctx.get("path", index)), indices, [height, width], crop, self.identity,
                        FUN_PREPROCESS_VERSION)
        cached = self.cache.get(key, required=["condition"])
        if cached is None:
            video = ctx.get("video", index)
            try:
                if control:
                    control_video = frames_to_tensor(_companion_frames(control, "control", ctx.get("media_info", index),
                                                                       indices, crop, height, width))
                else:
                    control_video = frames_to_tensor(derive_control(tensor_to_frames(video), derive)) if derive \
                        else None
            except UnreadableMediaError as error:
                raise UnreadableMediaError(ctx.get("path", index), f"{error.path}: {error.reason}") from error
            cached = {"condition": self._encode(control_video, video, height, width)}
            self.cache.put(key, cached)
        return {"condition": cached["condition"]}

    def _encode(self, control: torch.Tensor | None, video: torch.Tensor, height: int, width: int) -> torch.Tensor:
        encode = model_encoder(self.model)
        frames = video.shape[1]
        with self.lock, torch.no_grad():
            self.encode_calls += 1
            if self.model.variant.fun_condition_channels == 32:
                condition = fun_control_condition(encode, control, video[:, 0], frames, height, width)
            else:
                kept, mask = first_frame_inputs(video.float())
                condition = fun_control_a14b_condition(encode, control, kept, mask, frames, height, width)
        return condition.float().cpu()
