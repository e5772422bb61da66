from __future__ import annotations

from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.util.video_io import read_frames


class LoadVideo(PipelineModule):
    """Decodes the source frames chosen by FrameWindow ('frame_indices') as uint8 (F, H, W, 3) 'frames'; videos
    are decoded only up to the last frame needed. Raises UnreadableMediaError when a file that probed fine fails
    to decode (a file damaged in the middle)."""

    def __init__(self, path_name: str = "path", info_name: str = "media_info", indices_name: str = "frame_indices",
                 output_name: str = "frames", name: str | None = None):
        super().__init__(name)
        self.path_name = path_name
        self.info_name = info_name
        self.indices_name = indices_name
        self.output_name = output_name

    def needs(self) -> list[str]:
        return [self.path_name, self.info_name, self.indices_name]

    def produces(self) -> list[str]:
        return [self.output_name]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        frames = read_frames(ctx.get(self.path_name, index), ctx.get(self.indices_name, index),
                             ctx.get(self.info_name, index))
        return {self.output_name: frames}
