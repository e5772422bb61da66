"""uint8 (T, H, W, 3) RGB frame arrays after reading (modules/util/video_io.py): scaled and cropped to a bucket,
turned into the [-1, 1] tensors the VAE takes and back, and written as H.264 MP4 files."""
from __future__ import annotations

import os
from fractions import Fraction

import av
import cv2
import numpy as np

from modules.util.atomic import atomic_path


def as_fraction(fps: float | Fraction | int) -> Fraction:
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"a frame rate must be positive, got {fps}")
    return rate


def resize_and_crop(frames: np.ndarray, height: int, width: int, top: int | None = None, left: int | None = None,
                    flip: bool = False) -> np.ndarray:
    """Scales uint8 (T, H, W, 3) frames so that they cover height x width, then crops (centred unless `top` /
    `left` give the crop's corner in the scaled frame) and optionally mirrors them horizontally.

    Shrinking uses cv2.INTER_AREA, enlarging bicubic. `covering_size` tells the scaled size (for choosing a
    random top / left)."""
    frames = np.asarray(frames)
    src_h, src_w = frames.shape[1:3]
    new_h, new_w = covering_size(src_h, src_w, height, width)
    if (new_h, new_w) != (src_h, src_w):
        interpolation = cv2.INTER_AREA if new_h * new_w < src_h * src_w else cv2.INTER_CUBIC
        frames = np.stack([cv2.resize(frame, (new_w, new_h), interpolation=interpolation) for frame in frames])
    top = (new_h - height) // 2 if top is None else top
    left = (new_w - width) // 2 if left is None else left
    if not (0 <= top <= new_h - height and 0 <= left <= new_w - width):
        raise ValueError(f"crop corner ({top}, {left}) outside the scaled {new_h}x{new_w} frame for {height}x{width}")
    frames = frames[:, top:top + height, left:left + width]
    if flip:
        frames = frames[:, :, ::-1]
    return np.ascontiguousarray(frames)


def covering_size(src_h: int, src_w: int, height: int, width: int) -> tuple[int, int]:
    """The size (h, w) of a source scaled, aspect kept, to the smallest size covering height x width."""
    scale = max(height / src_h, width / src_w)
    return max(height, round(src_h * scale)), max(width, round(src_w * scale))


def frames_to_tensor(frames: np.ndarray):
    """uint8 (T, H, W, 3) -> float32 torch tensor (3, T, H, W) in [-1, 1]."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)


def tensor_to_frames(video) -> np.ndarray:
    """float (3, T, H, W) in [-1, 1] -> uint8 (T, H, W, 3): the inverse of frames_to_tensor."""
    return ((video.detach().float().cpu().permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float | Fraction, crf: int = 18) -> None:
    """Writes uint8 (T, H, W, 3) RGB frames as an H.264 yuv420p MP4 (moov first, so it streams).

    yuv420p needs even sides: an odd height or width is padded by repeating the last row or column. The file
    appears atomically (written beside the target, then renamed)."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or 0 in frames.shape:
        raise ValueError(f"write_video needs non-empty uint8 (T, H, W, 3) frames, got {frames.dtype} {frames.shape}")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    rate = as_fraction(fps)
    with atomic_path(path) as tmp:
        with av.open(str(tmp), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            # x264's macroblock tree encoded the same small frames (32x32) to different pixels from run to run
            # (5 outcomes in 25 encodes, with or without threads), so a dataset written twice differed and seeded
            # runs on it did too; without it every encode was the same (25 of 25, 40 of 40 with frame timestamps)
            stream.options = {"crf": str(int(crf)), "x264-params": "mbtree=0"}
            for index, frame in enumerate(frames):
                video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                video_frame.pts = index
                video_frame.time_base = 1 / rate
                for packet in stream.encode(video_frame):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
