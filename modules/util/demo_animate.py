"""The synthetic Wan2.2-Animate demo set (`make_demo_dataset --kind animate`): a character (a coloured block with a
head) follows a drawn stick-figure skeleton along a path. Per clip the target `<name>.mp4`, the skeleton alone on
black `<name>_pose.mp4` (what the official pose preprocessing renders), the head's crop `<name>_face.mp4`, the
character on grey `<name>_ref.png`, and for replace mode the scene without the character `<name>_bg.mp4` and its
mask `<name>_mask.mp4`: every video frame-aligned with the clip. The character's colour is the reference's, the
motion the skeleton's: a model that learns the set follows the pose of held-out skeletons. The captions name the
colour only ("a red person"), so the path is the pose's (or the driving video's) to say and cannot be read from the
caption. The Animate-2 set (`--kind animate-2`, make_animate_2_dataset) has a driving video instead of pose and face:
another performer doing the clip's motion."""
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image

from modules.util.atomic import atomic_dir
from modules.util.demo_assets import BACKGROUND, COLOURS
from modules.util.demo_model import set_latent_stats
from modules.util.demo_vae import set_cell_average_weights
from modules.util.portable_folder import make_portable
from modules.util.tiny_animate import make_animate_pipeline
from modules.util.tiny_models import replaceable_folder
from modules.util.video_frames import write_video

PATHS = ("left", "right", "up", "down")
FACE_SIZE = 32   # the demo's face crops (the release reads 512 x 512; the loader resizes them)


def _position(path: str, frame: int, frames: int, travel: int, offset: int) -> tuple[int, int]:
    # from `offset` steps along the path to its end, never jumping back (a jump would be a cue of its own)
    offset %= travel
    step = offset + round(frame * (travel - offset) / max(1, frames - 1))
    x, y = {"left": (travel - step, travel // 2), "right": (step, travel // 2),
            "up": (travel // 2, travel - step), "down": (travel // 2, step)}[path]
    return x, y


def animate_clip(colour, path: str, frames: int, size: int, offset: int = 0) -> dict[str, np.ndarray]:
    """The clip and its companions as uint8 arrays: target, pose, face (F, FACE_SIZE, FACE_SIZE, 3), background,
    mask, and the reference image."""
    body = max(6, size // 3)
    travel = size - body
    limb = max(1, size // 12)
    clip = np.full((frames, size, size, 3), BACKGROUND, np.uint8)
    pose = np.zeros_like(clip)
    mask = np.zeros_like(clip)
    face = np.zeros((frames, FACE_SIZE, FACE_SIZE, 3), np.uint8)
    background = np.full_like(clip, BACKGROUND)
    for f in range(frames):
        x, y = _position(path, f, frames, travel, offset)
        head = (x + body // 2, y + body // 4)
        clip[f, y + body // 3:y + body, x:x + body] = colour
        cv2.circle(clip[f], head, max(2, body // 5), (240, 210, 180), -1)
        mask[f, y + body // 3:y + body, x:x + body] = 255
        cv2.circle(mask[f], head, max(2, body // 5), (255, 255, 255), -1)
        # the skeleton: a spine, shoulders and hips in fixed colours, as OpenPose renders limbs (as thick, relative
        # to the frame, as its 4 px limbs at 512 px would be after the VAE's 8x downsampling: visible in the latents)
        cv2.line(pose[f], head, (x + body // 2, y + body - 1), (255, 255, 0), limb)
        cv2.line(pose[f], (x, y + body // 3), (x + body - 1, y + body // 3), (0, 255, 0), limb)
        cv2.line(pose[f], (x, y + body - 1), (x + body - 1, y + body - 1), (0, 128, 255), limb)
        top, left = max(0, head[1] - body // 3), max(0, head[0] - body // 3)
        crop = clip[f, top:top + 2 * (body // 3) + 1, left:left + 2 * (body // 3) + 1]
        face[f] = cv2.resize(crop, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_CUBIC)
    reference = np.full((size, size, 3), BACKGROUND, np.uint8)
    reference[size // 3:size - size // 6, size // 3:2 * size // 3] = colour
    cv2.circle(reference, (size // 2, size // 4), max(2, size // 10), (240, 210, 180), -1)
    return {"clip": clip, "pose": pose, "face": face, "background": background, "mask": mask,
            "reference": reference}


def _write_set(output: str | Path, clips_per_class: int, first_offset: int, offset_step: int, write_clip) -> Path:
    """Per colour, path and offset: `write_clip(output, stem, colour, path, offset)`, then the caption."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for colour_name, colour in COLOURS.items():
        for path in PATHS:
            for i in range(first_offset, first_offset + clips_per_class * offset_step, offset_step):
                stem = f"{colour_name}_{path}_{i:02d}"
                write_clip(output, stem, colour, path, i)
                (output / f"{stem}.txt").write_text(f"a {colour_name} person\n")
    return output


def make_animate_dataset(output: str | Path, clips_per_class: int = 2, frames: int = 9, size: int = 32,
                         fps: int = 30, first_offset: int = 0, offset_step: int = 1) -> Path:
    """`clips_per_class` clips per colour and path, the skeleton starting `first_offset`, `first_offset` +
    `offset_step`, ... pixels along its path (a held-out set: offsets the training set does not use)."""
    def write_clip(output, stem, colour, path, offset):
        parts = animate_clip(colour, path, frames, size, offset=offset)
        write_video(output / f"{stem}.mp4", parts["clip"], fps)
        for name, suffix in (("pose", "_pose"), ("face", "_face"), ("background", "_bg"), ("mask", "_mask")):
            write_video(output / f"{stem}{suffix}.mp4", parts[name], fps)
        Image.fromarray(parts["reference"]).save(output / f"{stem}_ref.png")
    return _write_set(output, clips_per_class, first_offset, offset_step, write_clip)


PERFORMER = (235, 235, 235)   # the Animate-2 demo's driving performer: one look for every clip, unlike the characters


def make_animate_2_dataset(output: str | Path, clips_per_class: int = 2, frames: int = 9, size: int = 32,
                           fps: int = 24, first_offset: int = 0, offset_step: int = 1) -> Path:
    """The Animate-2 set: per clip the target `<name>.mp4` (the character of `<name>_ref.png` moving along its path)
    and `<name>_driving.mp4`, another performer (always the same white one) doing the same motion, frame-aligned.
    A model that learns the set moves the reference's character as the driving performer moves."""
    def write_clip(output, stem, colour, path, offset):
        parts = animate_clip(colour, path, frames, size, offset=offset)
        write_video(output / f"{stem}.mp4", parts["clip"], fps)
        write_video(output / f"{stem}_driving.mp4", animate_clip(PERFORMER, path, frames, size, offset)["clip"], fps)
        Image.fromarray(parts["reference"]).save(output / f"{stem}_ref.png")
    return _write_set(output, clips_per_class, first_offset, offset_step, write_clip)


def make_demo_animate_model(output_dir: str | Path, seed: int = 0, size: int = 32, frames: int = 9) -> Path:
    """Writes the tiny Wan2.2-Animate model (`make_tiny_model --variant wan2.2-animate --squares-vae`) with the demo's
    VAE, which encodes each 8 x 8 cell as its colour, and latent statistics measured on the set's target clips
    (every colour, path and even start, `size` x `size`, `frames` frames); the transformer stays random.

    A random tiny VAE hardly encodes where anything is, so on it neither the pose latents a model sees nor the target
    it must reach say where the character is (modules/util/demo_vace.py measures the same for VACE). The statistics
    are the targets' alone, as the released VAE's are those of natural video, not of pose renderings: measured with
    the pose videos in them (black, where the clips are grey), every channel's spread was the two backgrounds' gap, so
    the four paths' normalised targets differed by a mean square of only 0.02 to 0.07 (0.3 to 1.0 on the targets'
    statistics) and a 300-step fine-tune followed 38 of 48 held-out poses, against 47 to 48 of 48
    (tests/test_animate_learning.py)."""
    output_dir = replaceable_folder(output_dir)
    pipeline = make_animate_pipeline("wan2.2-animate", seed)
    set_cell_average_weights(pipeline.vae)
    # each (F, H, W, 3) uint8 target -> (3, F, H, W) in [-1, 1]
    clips = [torch.from_numpy(animate_clip(colour, path, frames, size, offset)["clip"]).permute(3, 0, 1, 2)
             .float() / 127.5 - 1 for colour in COLOURS.values() for path in PATHS for offset in range(0, size, 2)]
    set_latent_stats(pipeline.vae, torch.stack(clips))
    with atomic_dir(output_dir) as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True)
        make_portable(tmp)
    return output_dir
