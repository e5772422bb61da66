""".npz clips (a uint8 (T, H, W, 3) frame array named 'frames', 'video' or 'arr_0', or else the one array of that
shape, and an optional 'fps'), checked from their .npy headers before anything is allocated: a forged header (a
billion frames, a negative side, pickled objects) is refused, never loaded."""
from __future__ import annotations

import contextlib
import math
import zipfile
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from modules.util.config.bounds import MAX_FPS
from modules.util.media_errors import UnreadableMediaError, describe_error
from modules.util.video_frames import as_fraction

NPZ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)

NPZ_FRAME_NAMES = ("frames", "video", "arr_0")


def _npz_frames_key(path: str, names: Sequence[str]) -> str | None:
    """The frame array of an .npz: by name (frames, video, arr_0: np.savez's name for an unnamed array), else the
    one array shaped like frames (4-D, 3 channels last), whatever the order of the archive's arrays."""
    for name in NPZ_FRAME_NAMES:
        if name in names:
            return name
    shaped = []
    for name in names:
        if name == "fps":
            continue
        shape, _, header_end, _ = _npy_header(path, name)
        if header_end is not None and len(shape) == 4 and shape[3] == 3:
            shaped.append(name)
    if len(shaped) == 1:
        return shaped[0]
    if len(shaped) > 1:
        raise UnreadableMediaError(path, f"several arrays look like frames ({', '.join(shaped)}); name the frame "
                                         f"array 'frames'")
    return None


@contextlib.contextmanager
def open_npz(path: str):
    """(the archive, the name of its frame array); every failure inside the block is an UnreadableMediaError."""
    if not zipfile.is_zipfile(path):
        raise UnreadableMediaError(path, "not an .npz archive (it is not a zip file)")
    try:
        with np.load(path, allow_pickle=False) as data:
            key = _npz_frames_key(path, data.files)
            if key is None:
                raise UnreadableMediaError(path, f"the .npz holds no frame array (a uint8 (T, H, W, 3) array named "
                                                 f"{', '.join(NPZ_FRAME_NAMES)}, or the only array of that shape; "
                                                 f"it has {', '.join(data.files) or 'no arrays'})")
            yield data, key
    except UnreadableMediaError:
        raise
    except NPZ_ERRORS as error:
        raise UnreadableMediaError(path, f"cannot read the .npz: {describe_error(error)}") from error


def npz_fps(path: str, data) -> Fraction | None:
    if "fps" not in data.files:
        return None
    value = np.asarray(data["fps"])
    if value.size != 1 or not np.issubdtype(value.dtype, np.number) or not float(value.reshape(())) > 0 \
            or not math.isfinite(float(value.reshape(()))):
        raise UnreadableMediaError(path, f"its 'fps' entry must be one positive number, got {value!r}")
    fps = float(value.reshape(()))
    if fps > MAX_FPS:  # 1e12 would time every frame within a picosecond: the clip would read as one frame
        raise UnreadableMediaError(path, f"its 'fps' entry is {fps:g}; a clip's frame rate is at most {MAX_FPS}")
    return as_fraction(fps)


MAX_NPZ_FRAME_BYTES = 16 * 2 ** 30  # far above any clip a Wan model trains on (81 x 1280x720x3 is 224 MB)


def _npy_header(path: str, key: str) -> tuple:
    """(shape, dtype, end of the header, stored size) of one array of the archive, from its .npy header alone; for
    a header version other than 1.0 / 2.0: (major, minor, None, None)."""
    with zipfile.ZipFile(path) as archive:
        stored = archive.getinfo(f"{key}.npy").file_size  # the member's uncompressed size
        with archive.open(f"{key}.npy") as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(member)
            else:
                return version[0], version[1], None, None
            return tuple(shape), dtype, member.tell(), stored


def checked_npz_header(path: str, key: str) -> tuple[int, ...]:
    """The frame array's shape, from its .npy header alone: a forged header (a billion frames, a shape of terabytes,
    an object array that would need unpickling) is refused before anything is allocated."""
    shape, dtype, header_end, stored = _npy_header(path, key)
    if header_end is None:  # numpy writes 3.0 only for structured dtypes: never a frame array
        raise UnreadableMediaError(path, f"its '{key}' array has a .npy header version {(shape, dtype)} that frame "
                                         f"arrays never have")
    check_frame_array(path, key, shape, dtype)
    needed = math.prod(shape) * np.dtype(dtype).itemsize
    if needed > MAX_NPZ_FRAME_BYTES:
        raise UnreadableMediaError(path, f"its '{key}' array declares {tuple(shape)} ({needed / 2 ** 30:.0f} GiB), "
                                         f"more than the {MAX_NPZ_FRAME_BYTES // 2 ** 30} GiB a clip may have")
    if stored != header_end + needed:
        raise UnreadableMediaError(path, f"its '{key}' array declares {tuple(shape)} ({needed} bytes), but the "
                                         f"archive stores {max(0, stored - header_end)} bytes of data")
    return tuple(shape)


def check_frame_array(path: str, key: str, shape: Sequence[int], dtype) -> None:
    if np.dtype(dtype).hasobject:
        raise UnreadableMediaError(path, f"its '{key}' array holds pickled Python objects, which are never loaded "
                                         f"(only a uint8 (T, H, W, 3) frame array is read)")
    if len(shape) != 4 or shape[3] != 3 or np.dtype(dtype) != np.uint8:
        raise UnreadableMediaError(path, f"its '{key}' array must be uint8 (T, H, W, 3), got {np.dtype(dtype)} "
                                         f"{tuple(shape)}")
    if any(side < 0 for side in shape):  # only a forged header has one; its byte count would come out negative
        raise UnreadableMediaError(path, f"its '{key}' array declares a negative size {tuple(shape)} (a damaged or "
                                         f"forged header)")
    if shape[0] == 0 or shape[1] == 0 or shape[2] == 0:
        raise UnreadableMediaError(path, f"its '{key}' array is empty: {tuple(shape)}")
