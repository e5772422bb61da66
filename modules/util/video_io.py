"""Reading videos, images and `.npz` clips as uint8 (T, H, W, 3) RGB frame arrays (resizing, tensors and
writing: modules/util/video_frames.py).

Every medium is a video here: an image is a one-frame video, a GIF is decoded by PyAV like any other video, and an
`.npz` clip holds a ready-made frame array (named 'frames', 'video' or 'arr_0', or else the one array shaped
(T, H, W, 3)) with an optional 'fps' key.

Frame rate resampling (`resample_indices`) works on the real presentation timestamps of the source frames
(pts * time_base, exact fractions), never on an assumed constant rate:

    source frame i is on screen from t_i until t_(i+1) (the last one until the clip's end time, which is its
    packet's pts + duration, or one more copy of the last frame interval when the container gives no duration).
    Output frame j is shown at time j / target_fps (times counted from the first frame) and takes the source frame
    at or just before that time: the largest i with t_i <= j / target_fps. The output holds every j whose time is
    before the clip's end time.

So a 16 fps source resampled to 16 fps is unchanged, 60 frames at 30 fps become 32 frames at 16 fps (output j takes
source floor(j * 30 / 16)), and a source slower than the target repeats frames.

Anything that cannot be read raises `UnreadableMediaError(path, reason)`, so that the caller can skip the file and
count it; only the errors that bad input produces are caught (av errors, OSError, ValueError, zip and PIL decode
errors), never everything.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import av.error
import numpy as np
from PIL import Image, ImageOps

from modules.util.media_errors import UnreadableMediaError, describe_error
from modules.util.npz_clips import check_frame_array, checked_npz_header, npz_fps, open_npz
from modules.util.video_frames import as_fraction

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".gif"})
CLIP_EXTENSIONS = frozenset({".npz"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS | CLIP_EXTENSIONS

MediaKind = Literal["image", "video", "clip", "frames"]

# the errors that a bad or truncated file makes PyAV raise (FFmpegError covers every av.error class)
_AV_ERRORS = (av.error.FFmpegError, OSError, ValueError, EOFError)
_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


@dataclass(frozen=True)
class MediaInfo:
    """What `probe_media` learns about a file without decoding all of it."""

    path: str
    kind: MediaKind
    width: int
    height: int
    frame_count: int
    # seconds from the first frame (timestamps[0] == 0); None for an .npz clip without an 'fps' key
    timestamps: tuple[Fraction, ...] | None
    # when the last frame stops being shown, in the same clock; None where timestamps are None
    end_time: Fraction | None
    # videos: the stream pts of frame i (presentation order), so a decode after a seek can tell which frame it has;
    # None when the container does not give every packet a pts (frames are then counted from the start)
    frame_pts: tuple[int, ...] | None = None
    time_base: Fraction | None = None
    seekable: bool = False
    _resampled: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def fps(self) -> float | None:
        """The average frame rate (frames per second of running time), None where unknown."""
        if self.timestamps is None or not self.end_time:
            return None
        return float(self.frame_count / self.end_time)

    def resample(self, target_fps: float | Fraction | None) -> list[int]:
        """Source frame indices of the clip at `target_fps` (None: every frame as it is); see the module doc."""
        if self.timestamps is None or self.end_time is None or target_fps is None:
            return list(range(self.frame_count))
        rate = as_fraction(target_fps)
        cached = self._resampled.get(rate)  # probes are cached and reused every epoch: resample once per rate
        if cached is None:
            cached = self._resampled[rate] = tuple(resample_indices(self.timestamps, self.end_time, rate))
        return list(cached)


def frame_files(folder: str | os.PathLike) -> list[Path]:
    """The images of a folder of frames (musubi-tuner's `video_path` naming a folder), in name order."""
    return sorted((p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS),
                  key=lambda p: p.name)


def media_kind(path: str | os.PathLike) -> MediaKind | None:
    if Path(path).is_dir():
        return "frames"
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    if ext in CLIP_EXTENSIONS:
        return "clip"
    return None


def resample_indices(timestamps: Sequence[Fraction], end_time: Fraction,
                     target_fps: float | Fraction | None) -> list[int]:
    """For each output frame j (time j / target_fps) the index of the source frame at or just before that time.

    `timestamps` are the source frames' presentation times in seconds, ascending, the first at 0; `end_time` is when
    the last one stops being shown. Output frames run while their time is before `end_time` (at least one). None
    keeps every frame. Exact: the comparisons are done in integers over a common denominator.
    """
    n = len(timestamps)
    if n == 0:
        return []
    if target_fps is None:
        return list(range(n))
    rate = as_fraction(target_fps)
    start = Fraction(timestamps[0])
    times = [Fraction(t) - start for t in timestamps]
    end = Fraction(end_time) - start
    den = math.lcm(end.denominator, *{t.denominator for t in times})
    # t_i <= j / rate  <=>  a_i <= j * b   with a_i = t_i * den * rate.numerator, b = den * rate.denominator
    b = den * rate.denominator
    a = [t.numerator * (den // t.denominator) * rate.numerator for t in times]
    limit = end.numerator * (den // end.denominator) * rate.numerator  # output j exists while j * b < limit
    result: list[int] = []
    i = 0
    j = 0
    while j == 0 or j * b < limit:
        while i + 1 < n and a[i + 1] <= j * b:
            i += 1
        result.append(i)
        j += 1
    return result


# ----------------------------------------------------------------------------------------------------------- probing

def probe_media(path: str | os.PathLike) -> MediaInfo:
    """Frame count, frame times and size of a video, image or .npz clip; raises UnreadableMediaError."""
    path = str(path)
    kind = media_kind(path)
    if kind is None:
        raise UnreadableMediaError(path, f"unsupported file type {Path(path).suffix!r}; "
                                         f"supported: {sorted(MEDIA_EXTENSIONS)}")
    if kind == "frames":
        return _probe_frame_folder(path)
    _check_file(path)
    if kind == "image":
        image = read_image(path)
        return MediaInfo(path, "image", image.shape[1], image.shape[0], 1, (Fraction(0),), None)
    if kind == "clip":
        return _probe_npz(path)
    return _probe_video(path)


def _probe_frame_folder(path: str) -> MediaInfo:
    """A folder of images is one clip, a frame per image in name order. Its images carry no frame times, so, as an
    .npz without 'fps', every image is one frame of the training clip (the dataset's own rate)."""
    files = frame_files(path)
    if not files:
        raise UnreadableMediaError(path, f"a folder of frames needs images ({', '.join(sorted(IMAGE_EXTENSIONS))}); "
                                         f"it has none")
    sizes = {}
    for file in files:
        _check_file(str(file))
        try:
            with Image.open(file) as image:  # the header only: nothing is decoded here
                _note_large_image(str(file), image.width, image.height)
                # EXIF orientations 5..8 turn the picture a quarter: read_image applies them
                turned = image.getexif().get(0x0112, 1) in (5, 6, 7, 8)
                size = (image.height, image.width) if turned else image.size
        except _IMAGE_ERRORS as error:
            raise UnreadableMediaError(path, f"frame {file.name}: cannot read the image: {describe_error(error)}") \
                from error
        sizes.setdefault(size, file.name)
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h} ({name})" for (w, h), name in sizes.items())
        raise UnreadableMediaError(path, f"its frames differ in size: {shown}; a clip's frames share one size")
    (width, height), = sizes
    return MediaInfo(path, "frames", width, height, len(files), None, None)


def with_frame_rate(info: MediaInfo, fps: float) -> MediaInfo:
    """A folder of frames (no frame times of its own) timed at `fps`, so that it resamples like a video."""
    rate = as_fraction(fps)
    timestamps = tuple(Fraction(i) / rate for i in range(info.frame_count))
    return MediaInfo(info.path, info.kind, info.width, info.height, info.frame_count, timestamps,
                     Fraction(info.frame_count) / rate)


def _check_file(path: str) -> None:
    try:
        size = os.path.getsize(path)
    except OSError as error:
        raise UnreadableMediaError(path, f"cannot read the file ({error.strerror or error})") from error
    if size == 0:
        raise UnreadableMediaError(path, "the file is empty (0 bytes)")


def _probe_video(path: str) -> MediaInfo:
    try:
        with av.open(path, mode="r") as container:
            if not container.streams.video:
                raise UnreadableMediaError(path, "the file has no video stream (truncated, or not a video?)")
            stream = container.streams.video[0]
            if stream.codec_context is None:
                raise UnreadableMediaError(path, "no decoder for the codec of its video stream")
            stream.thread_type = "AUTO"
            time_base = stream.time_base
            indexed_frames = stream.frames  # the container's own count (mp4/mov index), 0 when it has none
            pts: list[int] = []
            pts_missing = False
            end_pts: int | None = None
            first_frame: np.ndarray | None = None
            demuxed = 0
            for packet in container.demux(stream):
                if packet.size == 0 and packet.pts is None:
                    continue  # the demuxer's flush packet
                demuxed += 1
                if packet.is_discard:
                    pass  # before the start of an edit list: decoded for reference, never shown
                elif packet.pts is None:
                    pts_missing = True
                else:
                    pts.append(packet.pts)
                    if packet.duration:
                        end_pts = max(end_pts or packet.pts, packet.pts + packet.duration)
                if first_frame is None:  # decode until the first picture: proves the codec and gives the size
                    for frame in stream.decode(packet):
                        first_frame = frame.to_ndarray(format="rgb24")
                        break
            if first_frame is None:
                for frame in stream.decode(None):
                    first_frame = frame.to_ndarray(format="rgb24")
                    break
    except UnreadableMediaError:
        raise
    except _AV_ERRORS as error:
        raise UnreadableMediaError(path, f"cannot decode: {describe_error(error)}") from error
    if first_frame is None:
        raise UnreadableMediaError(path, "the video has no frames that decode")
    height, width = first_frame.shape[:2]
    if pts_missing or not pts or time_base is None:
        return _probe_video_by_decoding(path, width, height)
    unique = sorted(set(pts))
    count = len(unique)
    if indexed_frames and demuxed < indexed_frames:
        raise UnreadableMediaError(path, f"truncated: its index lists {indexed_frames} frames but only {demuxed} "
                                         f"could be read")
    base = unique[0]
    timestamps = tuple((p - base) * time_base for p in unique)
    if end_pts is not None and end_pts > unique[-1]:
        end_time = (end_pts - base) * time_base
    else:
        end_time = timestamps[-1] + _last_interval(timestamps, stream)
    return MediaInfo(path, "video", width, height, count, timestamps, end_time, tuple(unique), time_base,
                     seekable=Path(path).suffix.lower() != ".gif")


def _last_interval(timestamps: Sequence[Fraction], stream) -> Fraction:
    if len(timestamps) >= 2:
        return timestamps[-1] - timestamps[-2]
    rate = stream.average_rate or stream.guessed_rate
    return 1 / Fraction(rate) if rate else Fraction(1, 16)


def _probe_video_by_decoding(path: str, width: int, height: int) -> MediaInfo:
    """For containers whose packets lack timestamps: decode every frame and use the frames' own times."""
    times: list[Fraction] = []
    try:
        with av.open(path, mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            for index, frame in enumerate(container.decode(stream)):
                if frame.pts is not None and frame.time_base is not None:
                    times.append(frame.pts * frame.time_base)
                elif rate:
                    times.append(index / Fraction(rate))
                else:
                    times.append(Fraction(index, 16))
    except _AV_ERRORS as error:
        raise UnreadableMediaError(path, f"cannot decode: {describe_error(error)}") from error
    if not times:
        raise UnreadableMediaError(path, "the video has no frames that decode")
    if any(b <= a for a, b in zip(times, times[1:])):
        times = [Fraction(i) / Fraction(rate or 16) for i in range(len(times))]
    base = times[0]
    timestamps = tuple(t - base for t in times)
    interval = timestamps[-1] - timestamps[-2] if len(timestamps) >= 2 else 1 / Fraction(rate or 16)
    return MediaInfo(path, "video", width, height, len(timestamps), timestamps, timestamps[-1] + interval)


def _probe_npz(path: str) -> MediaInfo:
    with open_npz(path) as (data, key):
        fps = npz_fps(path, data)
        shape = checked_npz_header(path, key)
    count, height, width = shape[0], shape[1], shape[2]
    if fps is None:
        return MediaInfo(path, "clip", width, height, count, None, None)
    timestamps = tuple(Fraction(i) / fps for i in range(count))
    return MediaInfo(path, "clip", width, height, count, timestamps, Fraction(count) / fps)


# ----------------------------------------------------------------------------------------------------------- reading

_large_images_noted: set[str] = set()


def _note_large_image(path: str, width: int, height: int) -> None:
    """PIL's DecompressionBombWarning names no file (and scripts/_bootstrap.py hides it): say which image it is,
    once per file. Images above twice the limit are refused by PIL (DecompressionBombError, a skipped file)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit and path not in _large_images_noted:
        _large_images_noted.add(path)
        logging.getLogger(__name__).warning(
            "%s: %dx%d (%d pixels) is above PIL's decompression-bomb limit of %d pixels; read anyway (a picture "
            "this large costs time and memory to decode; shrink it if it is not meant to be so large)",
            path, width, height, width * height, limit)


def read_image(path: str | os.PathLike) -> np.ndarray:
    """An image as uint8 (H, W, 3) RGB, EXIF orientation applied, alpha dropped; raises UnreadableMediaError."""
    path = str(path)
    _check_file(path)
    try:
        with Image.open(path) as image:
            _note_large_image(path, image.width, image.height)
            image.load()  # decodes everything now: a truncated file fails here, not later
            image = ImageOps.exif_transpose(image)
            if image.mode != "RGB":
                image = image.convert("RGB")
            array = np.asarray(image, dtype=np.uint8)
    except _IMAGE_ERRORS as error:
        raise UnreadableMediaError(path, f"cannot read the image: {describe_error(error)}") from error
    if array.ndim != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise UnreadableMediaError(path, f"the image has no pixels ({array.shape})")
    return np.ascontiguousarray(array)


def read_frames(path: str | os.PathLike, indices: Sequence[int], info: MediaInfo | None = None) -> np.ndarray:
    """The source frames `indices` (any order, repeats allowed) as uint8 (len(indices), H, W, 3).

    Videos are decoded only as far as the last wanted frame, starting from the keyframe before the first wanted
    frame when the container can seek. `info` (from probe_media) saves probing the file again.
    """
    path = str(path)
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("read_frames needs at least one frame index")
    if info is None:
        info = probe_media(path)
    bad = [i for i in indices if not 0 <= i < info.frame_count]
    if bad:
        raise IndexError(f"{path}: frame indices {bad[:5]} outside 0..{info.frame_count - 1}")
    if info.kind == "image":
        image = read_image(path)
        return np.repeat(image[None], len(indices), axis=0)
    if info.kind == "clip":
        return _read_npz_frames(path, indices)
    if info.kind == "frames":
        files = frame_files(path)
        if len(files) != info.frame_count:
            raise UnreadableMediaError(path, f"it held {info.frame_count} frames when probed and {len(files)} now")
        images = {i: read_image(files[i]) for i in sorted(set(indices))}
        if len({image.shape for image in images.values()}) > 1:
            raise UnreadableMediaError(path, "its frames differ in size")
        return np.stack([images[i] for i in indices])
    frames = _decode_video(path, sorted(set(indices)), info)
    return np.stack([frames[i] for i in indices])


def read_media(path: str | os.PathLike, target_fps: float | Fraction | None = None,
               max_frames: int | None = None) -> np.ndarray:
    """A whole file (or its first `max_frames` frames) resampled to `target_fps` (None: as stored)."""
    info = probe_media(path)
    indices = info.resample(target_fps)
    if max_frames is not None:
        indices = indices[:max_frames]
    return read_frames(path, indices, info)


def _read_npz_frames(path: str, indices: list[int]) -> np.ndarray:
    with open_npz(path) as (data, key):
        checked_npz_header(path, key)
        array = data[key]
    check_frame_array(path, key, array.shape, array.dtype)
    return np.ascontiguousarray(array[indices])


def _decode_video(path: str, wanted: list[int], info: MediaInfo) -> dict[int, np.ndarray]:
    seek = info.seekable and info.frame_pts is not None and wanted[0] > 0
    try:
        frames = _decode_pass(path, wanted, info, seek)
        if frames is None:  # the seek landed after the first wanted frame: decode from the start instead
            frames = _decode_pass(path, wanted, info, False)
    except _AV_ERRORS as error:
        raise UnreadableMediaError(path, f"cannot decode: {describe_error(error)}") from error
    missing = [i for i in wanted if i not in frames]
    if missing:
        raise UnreadableMediaError(path, f"the stream ended before frame {missing[0]} of {info.frame_count} "
                                         f"(truncated or corrupt?)")
    shapes = {frame.shape for frame in frames.values()}
    if len(shapes) > 1:
        raise UnreadableMediaError(path, f"the frame size changes inside the video: {sorted(shapes)}")
    return frames


def _decode_pass(path: str, wanted: list[int], info: MediaInfo, seek: bool) -> dict[int, np.ndarray] | None:
    need = set(wanted)
    last = wanted[-1]
    pts_to_index = {p: i for i, p in enumerate(info.frame_pts)} if info.frame_pts is not None else None
    frames: dict[int, np.ndarray] = {}
    with av.open(path, mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        count: int | None = 0
        if seek:
            container.seek(info.frame_pts[wanted[0]], stream=stream, backward=True, any_frame=False)
            count = None  # frames can only be told apart by their pts now
        first = True
        for frame in container.decode(stream):
            if pts_to_index is not None and frame.pts in pts_to_index:
                index = pts_to_index[frame.pts]
            elif count is not None:
                index = count
            else:
                return None
            if first and seek and index > wanted[0]:
                return None
            first = False
            if count is not None:
                count += 1
            if index in need and index not in frames:
                frames[index] = frame.to_ndarray(format="rgb24")
            if index >= last:  # frames come in presentation order: nothing wanted follows
                break
    return frames


# ----------------------------------------------------------------------------------------------------------- image ops

__all__ = [
    "IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "CLIP_EXTENSIONS", "MEDIA_EXTENSIONS", "MediaInfo", "UnreadableMediaError",
    "media_kind", "probe_media", "resample_indices", "read_frames", "read_image", "read_media",
]
