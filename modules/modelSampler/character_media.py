"""A character model's sample inputs read as PIL images (Wan2.2-Animate's and Animate-2's samplers): an unreadable
file is a SampleError naming it."""
from PIL import Image

from modules.modelSampler.SampleResult import SampleError


def read_frames(path: str) -> list[Image.Image]:
    """Every frame of a video (or folder of frames) as stored."""
    from modules.util.video_io import UnreadableMediaError, read_media   # PyAV only where media is read
    try:
        return [Image.fromarray(frame) for frame in read_media(path)]
    except UnreadableMediaError as error:
        raise SampleError(f"{path!r} cannot be read: {error.reason}") from error


def read_reference(path: str) -> Image.Image:
    """The reference (character) image."""
    from modules.util.video_io import UnreadableMediaError, read_image
    try:
        return Image.fromarray(read_image(path))
    except UnreadableMediaError as error:
        raise SampleError(f"reference_image {path!r} cannot be read: {error.reason}") from error
