from __future__ import annotations

import math
from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class ResolutionBucket(PipelineModule):
    """Chooses each clip's (height, width) bucket from its probed size: 'resolution_bucket'.

    The buckets: for each aspect ratio r (width / height), the size of area resolution^2 with that ratio, each side
    rounded half up to the nearest multiple of `unit` (the VAE stride x patch: 16 for Wan 2.1 and A14B, 32 for TI2V-5B);
    duplicates removed. A clip gets the bucket whose aspect ratio is closest to its own (in log ratio; ties go to
    the earlier bucket). With `no_upscale`, a clip smaller than its bucket in either side keeps its own aspect instead:
    its size (shrunk to the bucket's area when larger), each side floored to a multiple of `unit` (never below one
    unit), so it is cropped by less than one unit per side and never enlarged.
    """

    def __init__(self, resolution: int, aspect_ratios: list[float], unit: int = 16, no_upscale: bool = False,
                 info_name: str = "media_info", name: str | None = None):
        super().__init__(name)
        self.unit = int(unit)
        self.no_upscale = no_upscale
        self.info_name = info_name
        self.buckets = self.make_buckets(resolution, aspect_ratios, self.unit)

    def needs(self) -> list[str]:
        return [self.info_name]

    def produces(self) -> list[str]:
        return ["resolution_bucket"]

    @staticmethod
    def make_buckets(resolution: int, aspect_ratios: list[float], unit: int) -> list[tuple[int, int]]:
        if not aspect_ratios or any(r <= 0 for r in aspect_ratios):
            raise ValueError(f"aspect ratios must be positive numbers; got {aspect_ratios}")
        buckets: list[tuple[int, int]] = []
        for ratio in aspect_ratios:  # sides rounded half up (the epsilon keeps exact halves from float noise)
            height = max(unit, math.floor(resolution / math.sqrt(ratio) / unit + 0.5 + 1e-9) * unit)
            width = max(unit, math.floor(resolution * math.sqrt(ratio) / unit + 0.5 + 1e-9) * unit)
            if (height, width) not in buckets:
                buckets.append((height, width))
        return buckets

    @staticmethod
    def choose(width: int, height: int, buckets: list[tuple[int, int]], unit: int,
               no_upscale: bool = False) -> tuple[int, int]:
        ratio = math.log(width / height)
        bucket_h, bucket_w = min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - ratio))
        if no_upscale and (bucket_h > height or bucket_w > width):
            # a source smaller than its bucket trains at its own aspect (no bucket aspect would fit it without
            # cropping or enlarging): its size, shrunk to the bucket's area if larger, each side floored to units
            scale = min(1.0, math.sqrt(bucket_h * bucket_w / (height * width)))
            bucket_h = max(unit, math.floor(height * scale / unit) * unit)
            bucket_w = max(unit, math.floor(width * scale / unit) * unit)
        return bucket_h, bucket_w

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        info = ctx.get(self.info_name, index)
        return {"resolution_bucket": self.choose(info.width, info.height, self.buckets, self.unit, self.no_upscale)}
