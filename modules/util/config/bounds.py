"""The bounds every config value is held to, in one place (docs/configuration.md lists them).

A value outside them is refused by the schema with the dotted field, so nothing unbounded reaches torch, the disk or
the model: a seed that does not fit torch's 64-bit generator, a frame rate that would resample a clip into billions
of frames, a path with a NUL byte that the operating system refuses with a traceback.
"""
import os
from typing import Annotated

from pydantic import AfterValidator, Field

# torch.Generator.manual_seed takes an unsigned 64-bit integer.
MAX_SEED = 2 ** 64 - 1
# Frames of one clip (4k+1): 64 s at Wan's 16 fps. Wan trains on 81; the bound only stops absurd values.
MAX_FRAMES = 1025
# A frame rate a video file can have (high-speed cameras record 240 fps).
MAX_FPS = 240
# Pixels on a side: bucket resolution, E2V resolutions, sample sizes (Wan 720p is 1280 x 720).
MAX_SIDE = 4096
# Width / height of a training bucket: from 1:16 to 16:1.
MIN_ASPECT_RATIO, MAX_ASPECT_RATIO = 1 / 16, 16.0
# Items per concept and epoch (balancing), and the multiplier (repeats): an epoch's item list is built in memory.
MAX_BALANCING = 1_000_000
MAX_REPEATS = 1000.0
# Adapter rank before the model is known (the model's narrowest targeted layer bounds it again, in validation.py).
MAX_RANK = 65536
# A learning rate (Prodigy's 1.0 is the largest any optimizer here uses; beyond 10 AdamW overflows to inf).
MAX_LEARNING_RATE = 10.0
# LoRA+'s learning-rate ratio of the B matrices (the paper uses 16; beyond this it is a typo for a learning rate).
MAX_LR_RATIO = 1000.0
# A list of numbers (aspect ratios, frame buckets): more entries than this is a copy-paste accident.
MAX_LIST = 1024

# distributed.timeout_minutes: a collective's longest wait. Below a minute a slow step or a rank-0 preview already
# stops the job; beyond a week a hung rank holds the GPUs unseen (and 1e308 overflows the process group's timedelta).
MIN_TIMEOUT_MINUTES, MAX_TIMEOUT_MINUTES = 1.0, 7 * 24 * 60.0

# Linux's PATH_MAX and NAME_MAX (most file systems), in bytes of the encoded path.
MAX_PATH_BYTES, MAX_NAME_BYTES = 4096, 255

Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="0..2^64-1")]


def check_usable_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path cannot contain a NUL character")
    try:
        encoded = os.fsencode(value)
    except UnicodeError:
        raise ValueError("a path must be text the file system can store (it holds an unpaired surrogate)") from None
    # the operating system refuses longer names with an OSError from the first stat()
    if len(encoded) > MAX_PATH_BYTES or any(len(name) > MAX_NAME_BYTES for name in encoded.split(b"/")):
        raise ValueError(f"a path is at most {MAX_PATH_BYTES} bytes, each folder or file name at most "
                         f"{MAX_NAME_BYTES}")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("required, but empty (an empty folder name would write into the current folder)")
    return value


# A path (or an empty string where the field allows "none").
PathText = Annotated[str, AfterValidator(check_usable_path)]
# A folder or file the run writes to: empty is refused.
WritePath = Annotated[str, AfterValidator(check_usable_path), AfterValidator(_not_blank)]


def _one_folder_name(value: str) -> str:
    # run_name: backups are found as <workspace>/backup/<name>/step-N; "exp/one" nested them one level deeper,
    # where no resume looked, and ".." wrote beside the workspace's folders
    if "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError("a run name is one folder name (no / or \\, not . or ..)")
    return value


FolderName = Annotated[str, AfterValidator(check_usable_path), AfterValidator(_one_folder_name)]
# A LoRA strength in comparisons and previews (sampling.compare_strengths, scripts/compare.py): beyond it the output
# is noise, and a larger number is a typo.
MAX_LORA_STRENGTH = 10.0
# loss.mask_gamma: grey mask weights raised to this power (beyond it every grey is black or white in float32).
MAX_MASK_GAMMA = 100.0
