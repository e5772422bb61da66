from __future__ import annotations

import logging
from fractions import Fraction
from typing import Any

from modules.dataLoader.pipeline.IndexMapModule import IndexMapModule

logger = logging.getLogger(__name__)


class FrameWindow(IndexMapModule):
    """Decides which source frames make each training clip, from the probe alone (nothing is decoded here).

    The clip is first resampled to the concept's fps (`fps`: a number, "model" for the model's rate, "source" to
    keep the file's frames; see video_io.resample_indices), giving N frames. The frame counts F it is cut at: the
    largest frame bucket <= min(N, max_frames); or, when the concept lists `target_frames`, every listed count
    <= min(N, max_frames), each making its own items (as musubi-tuner does). Per count, the extraction mode picks
    F of the N resampled frames:

    - head:    frames 0 .. F-1
    - uniform: frames round_half_up(i * (N-1) / (F-1)) for i in 0 .. F-1, spread over the whole clip
    - random:  F consecutive frames from a start drawn uniformly in 0 .. N-F, anew each epoch (module rng)
    - slide:   every window of F consecutive frames starting at 0, stride, 2 x stride, ... (start + F <= N);
               one item per window
    - chunk:   back-to-back windows of F consecutive frames (slide with stride F)
    - spaced:  `window_count` windows of F consecutive frames, starts floor(k * (N-F) / (window_count-1)) for
               k in 0 .. window_count-1 (musubi-tuner's "uniform"); coinciding starts are used once
    - full:    frames 0 .. F-1 with F the largest 4k+1 <= min(N, max_frames) (buckets and targets not used)

    It is an IndexMapModule: item i is window w of upstream clip u. A file whose probe failed, or whose N is
    shorter than every frame count it could be cut at, gets no item: it is skipped with one warning and listed in
    `skipped`. Produces 'frame_indices' (source frame indices for LoadVideo), 'frame_bucket' (F) and 'frame_fps'
    (the real rate of the extracted clip: fps x (F-1) / (N-1) for uniform, the concept's fps otherwise). A video
    shorter than the smallest video bucket (> 1) trains as a still image only when 1 is a bucket, with one notice.
    With `condition_frames` k (Animate's continuation frames, which carry no loss), windows of k frames or fewer
    are dropped, and a clip left with none is skipped the same way.
    `warned` (shared by every FrameWindow of a run) keeps each warning to once per run.
    """

    def __init__(self, frame_buckets: list[int], model_fps: int | float, name: str | None = None, *,
                 path_name: str = "path", concept_name: str = "concept", info_name: str = "media_info",
                 error_name: str = "media_error", warned: set | None = None, condition_frames: int = 0):
        super().__init__(name)
        # Animate's continuation frames: the leading frames of a window that carry no loss; a window no longer
        # than them would train nothing
        self.condition_frames = condition_frames
        buckets = sorted(set(int(b) for b in frame_buckets))
        bad = [b for b in buckets if b < 1 or (b - 1) % 4]
        if not buckets or bad:
            raise ValueError(f"frame buckets must be 4k+1 counts; got {frame_buckets}")
        self.frame_buckets = buckets
        self.model_fps = model_fps
        self.path_name = path_name
        self.concept_name = concept_name
        self.info_name = info_name
        self.error_name = error_name
        self._map: list[tuple[int, int, int]] = []  # (upstream clip, F, window start)
        self.skipped: list[tuple[str, str]] = []
        self._warned: set = warned if warned is not None else set()

    def needs(self) -> list[str]:
        return [self.path_name, self.concept_name, self.info_name, self.error_name]

    def produces(self) -> list[str]:
        return ["frame_indices", "frame_bucket", "frame_fps"]

    # ------------------------------------------------------------------------------------------------ planning

    def target_fps(self, concept: Any) -> Fraction | None:
        fps = getattr(concept, "fps", "model")
        if fps == "source":
            return None
        if fps == "model":
            fps = self.model_fps
        return Fraction(fps).limit_denominator(1001)

    def buckets_of(self, concept: Any) -> list[int]:
        """The concept's own frame buckets (diffusion-pipe's per-directory frame_buckets), else the run's."""
        return list(getattr(concept, "frame_buckets", None) or self.frame_buckets)

    def frame_counts(self, n: int, concept: Any) -> list[int]:
        """The counts F a clip of n resampled frames is cut at; empty when it is too short for all of them."""
        limit = min(n, int(getattr(concept, "max_frames", n)))
        buckets = self.buckets_of(concept)
        if getattr(concept, "extraction", "head") == "full":
            return [(limit - 1) // 4 * 4 + 1] if n >= buckets[0] and limit >= 1 else []
        targets = list(getattr(concept, "target_frames", None) or [])
        if targets:
            return [t for t in targets if t <= limit]
        fitting = [b for b in buckets if b <= limit]
        return fitting[-1:]

    @staticmethod
    def uniform_positions(n: int, f: int) -> list[int]:
        """round_half_up(i * (n-1) / (f-1)) in exact integer arithmetic."""
        if f == 1:
            return [0]
        return [(2 * i * (n - 1) + (f - 1)) // (2 * (f - 1)) for i in range(f)]

    @staticmethod
    def slide_starts(n: int, f: int, stride: int) -> list[int]:
        return list(range(0, n - f + 1, max(1, stride)))

    @staticmethod
    def spaced_starts(n: int, f: int, count: int) -> list[int]:
        if count == 1:
            return [0]
        return sorted({k * (n - f) // (count - 1) for k in range(count)})

    def windows(self, n: int, concept: Any) -> list[tuple[int, int]]:
        """(F, start) of every item one clip of n resampled frames makes (start 0 where the mode has none)."""
        extraction = getattr(concept, "extraction", "head")
        result = []
        for f in self.frame_counts(n, concept):
            if extraction == "slide":
                starts = self.slide_starts(n, f, int(getattr(concept, "slide_stride", 1)))
            elif extraction == "chunk":
                starts = self.slide_starts(n, f, f)
            elif extraction == "spaced":
                starts = self.spaced_starts(n, f, int(getattr(concept, "window_count", 1)))
            else:
                starts = [0]
            result.extend((f, start) for start in starts)
        return result

    @staticmethod
    def timed(info, concept: Any):
        """A folder of frames timed at its concept's frames_fps (musubi-tuner's source_fps), else as probed."""
        fps = getattr(concept, "frames_fps", None)
        if info is not None and info.kind == "frames" and fps:
            from modules.util.video_io import with_frame_rate
            return with_frame_rate(info, fps)
        return info

    def _plan(self, row: dict[str, Any]) -> tuple[list[tuple[int, int]], str | None]:
        """(the windows, skip reason) of one upstream clip."""
        info = row[self.info_name]
        if info is None:
            return [], row[self.error_name] or "unreadable"
        concept = row[self.concept_name]
        info = self.timed(info, concept)
        target = self.target_fps(concept)
        n = len(info.resample(target))
        windows = self.windows(n, concept)
        carrying = [(f, start) for f, start in windows if f > self.condition_frames]
        if windows and not carrying:
            return [], (f"cut at {windows[0][0]} frame(s), no longer than animate.continuation_frames "
                        f"({self.condition_frames}): no frame of it would carry loss")
        windows = carrying
        if not windows:
            rate = f"at {float(target):g} fps" if target is not None else "at its own fps"
            targets = list(getattr(concept, "target_frames", None) or [])
            if getattr(concept, "extraction", "head") == "full":
                targets = []
            shortest, what = (targets[0], "target frame count") if targets else (self.buckets_of(concept)[0],
                                                                                  "frame bucket")
            if n < shortest:
                return [], f"{n} frame(s) {rate} is shorter than the smallest {what} ({shortest})"
            return [], f"max_frames {int(getattr(concept, 'max_frames', n))} is below the smallest {what} ({shortest})"
        # a 1-frame item that target_frames asked for (musubi-tuner's [1, ...]) is no fallback: no notice
        targeted = bool(getattr(concept, "target_frames", None)) and getattr(concept, "extraction", "head") != "full"
        if n > 1 and info.kind != "image" and not targeted and windows[0][0] == 1:
            videos = [b for b in self.buckets_of(concept) if b > 1]
            shortest = f"the smallest video bucket ({videos[0]})" if videos else "every video bucket (there is none)"
            self._warn_once(str(row[self.path_name]), f"{n} frames is shorter than {shortest}: it trains as a still "
                                                     f"image (its first frame, frame bucket 1)", "notice: %s: %s")
        return windows, None

    def _warn_once(self, path: str, reason: str, form: str = "skipping %s: %s") -> None:
        if (path, reason) not in self._warned:
            self._warned.add((path, reason))
            logger.warning(form, path, reason)

    def start_epoch(self, ctx) -> None:
        mapping: list[tuple[int, int]] = []
        skipped: list[tuple[str, str]] = []
        for upstream, row in enumerate(ctx.get_all(self.needs())):
            windows, reason = self._plan(row)
            if reason is not None:
                skipped.append((str(row[self.path_name]), reason))
                self._warn_once(str(row[self.path_name]), reason)
            mapping.extend((upstream, f, start) for f, start in windows)
        self._map = mapping
        self.skipped = skipped

    def length(self) -> int:
        return len(self._map)

    def upstream_index(self, index: int) -> int:
        return self._map[index][0]

    # ------------------------------------------------------------------------------------------------ items

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        upstream, f, start = self._map[index]
        concept = ctx.get(self.concept_name, upstream)
        info = self.timed(ctx.get(self.info_name, upstream), concept)
        target = self.target_fps(concept)
        resampled = info.resample(target)
        n = len(resampled)
        extraction = getattr(concept, "extraction", "head")
        if extraction == "uniform":
            positions = self.uniform_positions(n, f)
        elif extraction == "random":
            start = self.rng(ctx, index, int(getattr(concept, "seed", 0))).randint(0, n - f)
            positions = list(range(start, start + f))
        elif extraction in ("head", "full", "slide", "chunk", "spaced"):
            positions = list(range(start, start + f))
        else:
            raise ValueError(f"unknown extraction mode {extraction!r}")
        fps = float(target) if target is not None else (info.fps or float(self.model_fps))
        if extraction == "uniform" and f > 1 and n > f:
            fps *= (f - 1) / (n - 1)  # F frames span the whole clip: its real rate is lower (motion plays faster)
        return {"frame_indices": [resampled[p] for p in positions], "frame_bucket": f, "frame_fps": fps}
