"""A VACE sample's inputs: the control video, its mask and the reference images read from their files, checked
against the sample's size and length, and made into the control context with the shared code
(modules/model/vace_condition.py) as training makes it."""
from pathlib import Path

import numpy as np
import torch

from modules.model.vace_condition import image_to_tensor, mask_from_frames, model_encoder, vace_context
from modules.util.media_errors import UnreadableMediaError
from modules.util.video_frames import frames_to_tensor, resize_and_crop


class VaceInputError(ValueError):
    pass


def _clip_problem(path: str, label: str, frames: int) -> str | None:
    """What keeps a control / mask video file from serving a sample of `frames` frames (probed: a video's frames are
    counted, not decoded), or None."""
    from modules.util.video_io import media_kind, probe_media
    if not Path(path).exists():
        return f"{label} {path!r} does not exist"
    kind = media_kind(path)
    mask_image = label == "mask video" and kind == "image"   # one mask image for every frame, as in training
    if not mask_image and kind not in ("video", "frames"):
        return (f"{label} {path!r} is not a video or a folder of frames"
                + (" (or one image for every frame)" if label == "mask video" else ""))
    try:
        info = probe_media(path)
    except UnreadableMediaError as error:
        return f"{label} {path!r} cannot be read: {error.reason}"
    if not mask_image and info.frame_count < frames:
        return (f"{label} {path!r} has {info.frame_count} frames; the sample has {frames} (a control is never "
                f"padded: give at least as many frames, or sample fewer)")
    return None


def _reference_problem(path: str) -> str | None:
    from modules.util.video_io import media_kind, probe_media
    if not Path(path).is_file():
        return f"reference image {path!r} does not exist (or is not a file)"
    if media_kind(path) != "image":
        return f"reference image {path!r} is not an image (a reference is one picture, not a video)"
    try:
        probe_media(path)
    except UnreadableMediaError as error:
        return f"reference image {path!r} cannot be read: {error.reason}"
    return None


def _aspect_problem(control_video: str, mask_video: str) -> str | None:
    """Each is covered and cropped to the sample's size on its own: of another aspect ratio, the mask would mark
    another region of the control than the one its pixels show (training names such a mask too)."""
    from modules.util.video_io import probe_media
    control, mask = probe_media(control_video), probe_media(mask_video)   # both read by _clip_problem already
    if mask.width * control.height != mask.height * control.width:
        return (f"mask video {mask_video!r} is {mask.width}x{mask.height}, the control video "
                f"{control.width}x{control.height}; a mask must have the control's aspect ratio")
    return None


def control_file_problems(control_video: str, mask_video: str, reference_images: list[str], frames: int) -> list[str]:
    """Every problem of a VACE / Wan-Fun Control sample's control video, mask video and reference images that the
    files show without a model (existence, kind, readability, length against the sample's `frames` (4k+1), the
    mask's aspect ratio), each a sentence naming the file: scripts/sample.py asks before any model loads."""
    clips = [(path, label) for path, label in ((control_video, "control video"), (mask_video, "mask video")) if path]
    problems = [problem for path, label in clips for problem in [_clip_problem(path, label, frames)] if problem]
    if control_video and mask_video and not problems:
        problems += [problem for problem in [_aspect_problem(control_video, mask_video)] if problem]
    return problems + [problem for path in reference_images for problem in [_reference_problem(path)] if problem]


def _read_clip(path: str, frames: int, height: int, width: int) -> np.ndarray:
    """The first `frames` frames of a checked video file or frames folder (a mask: or one image), covered and
    centre-cropped to height x width (as the data path crops clips)."""
    from modules.util.video_io import media_kind, read_image, read_media
    try:
        if media_kind(path) == "image":
            return resize_and_crop(np.repeat(read_image(path)[None], frames, axis=0), height, width)
        return resize_and_crop(read_media(path, max_frames=frames), height, width)
    except UnreadableMediaError as error:
        raise VaceInputError(f"{path!r} cannot be read: {error.reason}") from error


def _read_reference(path: str) -> torch.Tensor:
    from modules.util.video_io import read_image
    try:
        return image_to_tensor(read_image(path))
    except UnreadableMediaError as error:
        raise VaceInputError(f"reference image {path!r} cannot be read: {error.reason}") from error


def load_vace_inputs(control_video: str, mask_video: str, reference_images: list[str], frames: int, height: int,
                     width: int) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
    """(3, F, H, W) control in [-1, 1] or None, (1, F, H, W) mask in [0, 1] (mask_from_frames, as training reads
    it; white = generate) or None, references (3, h, w) in [-1, 1] in the order given (fitted onto the video's size
    later); VaceInputError naming every problem of control_file_problems."""
    if problems := control_file_problems(control_video, mask_video, reference_images, frames):
        raise VaceInputError("; ".join(problems))
    video = frames_to_tensor(_read_clip(control_video, frames, height, width)) if control_video else None
    mask = None
    if mask_video:
        mask = mask_from_frames(_read_clip(mask_video, frames, height, width))
    return video, mask, [_read_reference(path) for path in reference_images]


def check_vace_sample(variant, sample) -> None:
    """Control inputs only for a VACE model; a VACE model takes no first / last frame (its references do that)."""
    given = [name for name in ("control_video", "mask_video", "reference_images") if getattr(sample, name)]
    if variant.is_animate:   # Animate's mask video and one reference image (sample.py's --reference-image fills both)
        given = [name for name in given if name == "control_video"
                 or (name == "reference_images" and list(sample.reference_images) != [sample.reference_image])]
    if variant.is_fun_control:   # Wan-Fun Control: a control video; the A14B model also a mask video
        takes = ("control_video", "mask_video") if variant.takes_control_mask else ("control_video",)
        if extra := [name for name in given if name not in takes]:
            raise VaceInputError(f"sample {sample.prompt[:40]!r}: {variant} (Wan-Fun Control) takes "
                                 f"{' and '.join(takes)}, not {', '.join(extra)} (its start image is `image`)")
        return
    if given and not variant.is_vace:
        raise VaceInputError(f"sample {sample.prompt[:40]!r}: {', '.join(given)} need a VACE or Wan-Fun Control "
                             f"model; {variant} takes none")
    if variant.is_vace and (sample.image or sample.last_image):
        raise VaceInputError(f"sample {sample.prompt[:40]!r}: a VACE model takes no image / last_image; give the "
                             f"picture as a reference image (or as the control video's first frame with a mask)")


def sample_context(model, sample) -> tuple[torch.Tensor, int]:
    """The control context (96, n + T, h, w) of a resolved sample and its reference count (the VAE must be placed)."""
    video, mask, references = load_vace_inputs(sample.control_video, sample.mask_video,
                                               list(sample.reference_images), sample.frames, sample.height,
                                               sample.width)
    with torch.no_grad():
        context = vace_context(model_encoder(model), video, mask, references, num_frames=sample.frames,
                               height=sample.height, width=sample.width)
    return context, len(references)
