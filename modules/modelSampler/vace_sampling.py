"""A VACE sample's inputs: the control video, its mask and the reference images read from their files, checked
against the sample's size and length, and made into the control context with the shared code
(modules/model/vace_condition.py) as training makes it."""
from pathlib import Path

import numpy as np
import torch

from modules.model.vace_condition import image_to_tensor, model_encoder, vace_context
from modules.util.media_errors import UnreadableMediaError
from modules.util.video_frames import frames_to_tensor, resize_and_crop


class VaceInputError(ValueError):
    pass


def _read_clip(path: str, label: str, frames: int, height: int, width: int) -> np.ndarray:
    """The first `frames` frames of a video file or frames folder, covered and centre-cropped to height x width
    (as the data path crops clips); fewer frames than the sample has is an error naming the file."""
    from modules.util.video_io import media_kind, read_image, read_media
    if not Path(path).exists():
        raise VaceInputError(f"{label} {path!r} does not exist")
    if label == "mask video" and media_kind(path) == "image":   # one mask image for every frame, as in training
        try:
            return resize_and_crop(np.repeat(read_image(path)[None], frames, axis=0), height, width)
        except UnreadableMediaError as error:
            raise VaceInputError(f"{label} {path!r} cannot be read: {error.reason}") from error
    if media_kind(path) not in ("video", "frames"):
        raise VaceInputError(f"{label} {path!r} is not a video or a folder of frames")
    try:
        clip = read_media(path, max_frames=frames)
    except UnreadableMediaError as error:
        raise VaceInputError(f"{label} {path!r} cannot be read: {error.reason}") from error
    if len(clip) < frames:
        raise VaceInputError(f"{label} {path!r} has {len(clip)} frames; the sample has {frames} (a control is never "
                             f"padded: give at least as many frames, or sample fewer)")
    return resize_and_crop(clip, height, width)


def _read_reference(path: str) -> torch.Tensor:
    from modules.util.video_io import media_kind, read_image
    if not Path(path).is_file():
        raise VaceInputError(f"reference image {path!r} does not exist (or is not a file)")
    if media_kind(path) != "image":
        raise VaceInputError(f"reference image {path!r} is not an image (a reference is one picture, not a video)")
    try:
        return image_to_tensor(read_image(path))
    except UnreadableMediaError as error:
        raise VaceInputError(f"reference image {path!r} cannot be read: {error.reason}") from error


def _check_same_aspect(control_video: str, mask_video: str) -> None:
    """Each is covered and cropped to the sample's size on its own: of another aspect ratio, the mask would mark
    another region of the control than the one its pixels show (training names such a mask too)."""
    from modules.util.video_io import probe_media
    try:
        control, mask = probe_media(control_video), probe_media(mask_video)
    except UnreadableMediaError as error:
        raise VaceInputError(f"{error.path!r} cannot be read: {error.reason}") from error
    if mask.width * control.height != mask.height * control.width:
        raise VaceInputError(f"mask video {mask_video!r} is {mask.width}x{mask.height}, the control video "
                             f"{control.width}x{control.height}; a mask must have the control's aspect ratio")


def load_vace_inputs(control_video: str, mask_video: str, reference_images: list[str], frames: int, height: int,
                     width: int) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
    """(3, F, H, W) control in [-1, 1] or None, (1, F, H, W) mask binarised at 0.5 (white = generate) or None,
    references (3, h, w) in [-1, 1] in the order given (fitted onto the video's size later)."""
    video = frames_to_tensor(_read_clip(control_video, "control video", frames, height, width)) \
        if control_video else None
    mask = None
    if mask_video:
        if control_video:
            _check_same_aspect(control_video, mask_video)
        pixels = _read_clip(mask_video, "mask video", frames, height, width)
        mask = torch.from_numpy((pixels.mean(axis=-1) / 255.0 > 0.5).astype(np.float32))[None]
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
