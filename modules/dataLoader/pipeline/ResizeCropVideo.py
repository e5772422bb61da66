from __future__ import annotations

from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.util.video_frames import covering_size, frames_to_tensor, resize_and_crop


class ResizeCropVideo(PipelineModule):
    """Scales the uint8 frames to cover the resolution bucket (INTER_AREA when shrinking, bicubic when enlarging),
    crops to it (centred, or at a random offset with `crop_jitter`), mirrors with probability 1/2 with `flip`;
    jitter and flip come from the module rng, so they are the same for every frame of the clip and replayable.

    Produces 'video', float32 (3, F, H, W) in [-1, 1], and 'crop' (scaled size, top, left, flip) so that masks or
    other per-pixel inputs of the same clip can follow the same geometry.
    """

    def __init__(self, crop_jitter: bool = False, flip: bool = False, frames_name: str = "frames",
                 bucket_name: str = "resolution_bucket", output_name: str = "video", name: str | None = None):
        super().__init__(name)
        self.crop_jitter = crop_jitter
        self.flip = flip
        self.frames_name = frames_name
        self.bucket_name = bucket_name
        self.output_name = output_name

    def needs(self) -> list[str]:
        return [self.frames_name, self.bucket_name]

    def produces(self) -> list[str]:
        return [self.output_name, "crop"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        frames = ctx.get(self.frames_name, index)
        height, width = ctx.get(self.bucket_name, index)
        scaled_h, scaled_w = covering_size(frames.shape[1], frames.shape[2], height, width)
        rng = self.rng(ctx, index)
        draw_top, draw_left, draw_flip = rng.random(), rng.random(), rng.random()  # always drawn: stable streams
        if self.crop_jitter:
            top = int(draw_top * (scaled_h - height + 1))
            left = int(draw_left * (scaled_w - width + 1))
        else:
            top, left = (scaled_h - height) // 2, (scaled_w - width) // 2
        flipped = self.flip and draw_flip < 0.5
        cropped = resize_and_crop(frames, height, width, top, left, flipped)
        crop = {"scaled_size": (scaled_h, scaled_w), "top": top, "left": left, "flip": flipped}
        return {self.output_name: frames_to_tensor(cropped), "crop": crop}
