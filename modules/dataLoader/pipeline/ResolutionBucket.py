from __future__ import annotations

import logging
import math
from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.util.resolution import make_buckets


class ResolutionBucket(PipelineModule):
    """Chooses each clip's (height, width) bucket from its probed size: 'resolution_bucket'.

    The buckets are those of `resolution` and `aspect_ratios` (modules/util/resolution.py: "480p" / "WxH" give
    exactly that size for its aspect ratio, an integer N the area N^2 for every ratio), sides multiples of `unit`
    (the VAE stride x patch: 16 for Wan 2.1 and A14B, 32 for TI2V-5B). A clip gets the bucket whose aspect ratio is
    closest to its own (in log ratio; ties go to the earlier bucket). With `no_upscale`, a clip smaller than its
    bucket in either side keeps its own aspect instead: its size (shrunk to the bucket's area when larger), each side
    floored to a multiple of `unit` (never below one unit), so it is cropped by less than one unit per side and never
    enlarged.
    """

    def __init__(self, resolution: int | str, aspect_ratios: list[float], unit: int = 16, no_upscale: bool = False,
                 info_name: str = "media_info", name: str | None = None, path_name: str = "path",
                 concept_name: str = "concept", warned: set | None = None):
        super().__init__(name)
        self.unit = int(unit)
        self.no_upscale = no_upscale
        self.info_name = info_name
        self.path_name = path_name
        self.concept_name = concept_name
        self.resolution, self.aspect_ratios = resolution, list(aspect_ratios)
        self.buckets = self.make_buckets(resolution, aspect_ratios, self.unit)
        self._concept_buckets: dict[tuple, list[tuple[int, int]]] = {}
        self._warned: set = warned if warned is not None else set()

    def needs(self) -> list[str]:
        return [self.info_name, self.path_name, self.concept_name]

    def buckets_of(self, concept: Any) -> list[tuple[int, int]]:
        """The concept's own buckets (diffusion-pipe's per-directory resolutions / ar_buckets), else the run's."""
        resolution = getattr(concept, "resolution", None)
        ratios = getattr(concept, "aspect_ratios", None)
        if resolution is None and ratios is None:
            return self.buckets
        key = (resolution if resolution is not None else self.resolution, tuple(ratios or self.aspect_ratios))
        if key not in self._concept_buckets:
            self._concept_buckets[key] = self.make_buckets(key[0], list(key[1]), self.unit)
        return self._concept_buckets[key]

    def produces(self) -> list[str]:
        return ["resolution_bucket"]

    @staticmethod
    def make_buckets(resolution: int | str, aspect_ratios: list[float], unit: int) -> list[tuple[int, int]]:
        return make_buckets(resolution, aspect_ratios, unit)

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
        buckets = self.buckets_of(ctx.get(self.concept_name, index))
        bucket = self.choose(info.width, info.height, buckets, self.unit, self.no_upscale)
        if min(info.width, info.height) < self.unit:
            self._note_tiny(str(ctx.get(self.path_name, index)), info.width, info.height, bucket)
        return {"resolution_bucket": bucket}

    def _note_tiny(self, path: str, width: int, height: int, bucket: tuple[int, int]) -> None:
        """A source smaller than one latent cell on a side (a 1x1 placeholder, a favicon) is blown up to its
        bucket and teaches little but blur: trained, with one notice per run."""
        key = (path, "tiny source")
        if key not in self._warned:
            self._warned.add(key)
            logging.getLogger(__name__).warning(
                "notice: %s is %dx%d, smaller than one latent cell (%d pixels) on a side: it trains enlarged to "
                "%dx%d (width x height), which teaches little; remove it if it is a placeholder", path, width,
                height, self.unit, bucket[1], bucket[0])
