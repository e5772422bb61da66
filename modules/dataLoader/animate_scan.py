"""Finding each clip's Wan2.2-Animate / Animate-2 companions before any model loads (docs/animate.md).

Wan2.2-Animate, per clip `<name>.mp4`: `<name>_pose.mp4` (the driving skeleton), `<name>_face.mp4` (the face crops),
`<name>_ref.png` (the character), and for replace mode `<name>_bg.mp4` (the scene without the character) and
`<name>_mask.mp4` (the character's mask, white = character), each any media extension; in a `.jsonl` manifest the same
names as keys (`pose`, `face`, `ref`, `bg`, `mask`; `_path` forms accepted). Wan2.2-Animate-2, per clip:
`<name>_driving.mp4` (another performer doing the clip's motion) and `<name>_ref.png` (keys `driving`, `ref`).
Companion videos are frame-aligned with the clip: they have its frame count, so frame i of each is frame i of the
clip and the frame window the clip draws is read from each. Companions are not clips of their own, and in an Animate
dataset `<name>_mask` is the replace mask, not a loss mask.

A clip is skipped, naming the reason, when a needed companion is missing or unreadable, when a companion video's
frame count differs from the clip's (a short pose video would end the motion early), or when its pose (driving) video
is the clip itself (a common mistake: the model then learns to copy its input, with a near-zero loss that teaches
nothing).
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modules.dataLoader.concept_scan import ScanResult, manifest_entry_path, scan_concepts
from modules.util.video_io import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, UnreadableMediaError, probe_media, read_frames


@dataclass(frozen=True)
class CompanionSet:
    """A model's companions: what the scanner looks for beside each clip and in manifests."""
    suffixes: dict            # companion name -> file name suffix
    manifest_keys: dict       # companion name -> the manifest keys naming it
    what: dict                # companion name -> how messages call it
    always: tuple             # needed in every mode
    replace: tuple            # needed in replace mode too
    motion: str               # the companion that carries the motion: refused when it is the clip itself
    motion_is_not: str        # what that companion must be instead ("a rendered pose")
    how_to_make: str          # where docs/animate.md says how to make it


ANIMATE = CompanionSet(
    suffixes={"pose": "_pose", "face": "_face", "reference": "_ref", "background": "_bg", "mask": "_mask"},
    manifest_keys={"pose": ("pose", "pose_path", "pose_video"), "face": ("face", "face_path", "face_video"),
                   "reference": ("ref", "ref_path", "reference", "reference_image"),
                   "background": ("bg", "bg_path", "background", "background_video"),
                   "mask": ("mask", "mask_path", "mask_video")},
    what={"pose": "pose video", "face": "face video", "reference": "reference image",
          "background": "background video", "mask": "mask video"},
    always=("pose", "face", "reference"), replace=("background", "mask"), motion="pose",
    motion_is_not="not a rendered pose", how_to_make="make it with the official preprocessing (docs/animate.md)")
ANIMATE_2 = CompanionSet(
    suffixes={"driving": "_driving", "reference": "_ref"},
    manifest_keys={"driving": ("driving", "driving_path", "driving_video"),
                   "reference": ("ref", "ref_path", "reference", "reference_image")},
    what={"driving": "driving video", "reference": "reference image"},
    always=("driving", "reference"), replace=(), motion="driving",
    motion_is_not="not another performer doing its motion",
    how_to_make="film or render another performer doing the clip's motion (docs/animate.md)")

_ORDER = [".mp4", ".png"] + sorted(MEDIA_EXTENSIONS - {".mp4", ".png"})
SAME_FRAME_LEVEL = 2.0   # mean absolute difference (0..255) below which two frames are the same picture


def companion_set(variant) -> CompanionSet:
    """The companions `variant` trains with: Animate-2's driving video, or Animate's pose / face videos."""
    return ANIMATE_2 if variant is not None and variant.takes_driving_video else ANIMATE


def needed(mode: str, companions: CompanionSet = ANIMATE) -> tuple[str, ...]:
    return companions.always + (companions.replace if mode == "replace" else ())


def is_companion(path: Path, media: set[Path], companions: CompanionSet = ANIMATE) -> bool:
    """`<stem>_pose.mp4` (or another suffix of the set) beside a media file `<stem>.<ext>`."""
    for suffix in companions.suffixes.values():
        if path.stem.endswith(suffix):
            stem = path.stem[:-len(suffix)]
            if any(o.parent == path.parent and o.stem == stem and o != path for o in media):
                return True
    return False


def _beside(media: Path, suffix: str, images_only: bool = False) -> Path | None:
    for extension in _ORDER:
        if images_only and extension not in IMAGE_EXTENSIONS:
            continue
        candidate = media.parent / f"{media.stem}{suffix}{extension}"
        if candidate.is_file():
            return candidate
    return None


def _manifest_companions(manifest: Path, companions: CompanionSet) -> dict[str, dict[str, Path]]:
    """media path -> companion name -> path, from the manifest's companion keys."""
    from modules.dataLoader.concept_scan import MANIFEST_MEDIA_KEYS
    out: dict[str, dict[str, Path]] = {}
    for line in manifest.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line) if line.strip() else None
        except ValueError:
            continue   # the concept scan names the bad line
        if not isinstance(entry, dict):
            continue
        media = next((entry[k] for k in MANIFEST_MEDIA_KEYS if isinstance(entry.get(k), str)), None)
        if media is None:
            continue
        out[str(manifest_entry_path(manifest, media))] = {
            name: manifest_entry_path(manifest, entry[key]) for name, keys in companions.manifest_keys.items()
            for key in keys if isinstance(entry.get(key), str) and entry[key]}
    return out


def find_companions(media: Path, listed: dict[str, Path] | None = None,
                    companions: CompanionSet = ANIMATE) -> dict[str, Path | None]:
    listed = listed or {}
    return {name: listed.get(name) or _beside(media, suffix, images_only=name == "reference")
            for name, suffix in companions.suffixes.items()}


def _same_picture(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean()) < SAME_FRAME_LEVEL


def companion_problem(media: Path, companions: dict[str, Path | None], mode: str,
                      kind: CompanionSet = ANIMATE) -> str | None:
    """Why the clip cannot train as an Animate (Animate-2) item, or None."""
    for name in needed(mode, kind):
        path = companions.get(name)
        if path is None:
            return (f"no {kind.what[name]} ({media.stem}{kind.suffixes[name]}."
                    f"{'png' if name == 'reference' else 'mp4'} beside it, or '{kind.manifest_keys[name][0]}' in the "
                    f"manifest)")
        if not path.is_file():
            return f"its {kind.what[name]} {path} does not exist"
    try:
        clip = probe_media(media)
        for name in needed(mode, kind):
            if name == "reference":
                continue
            info = probe_media(companions[name])
            if info.frame_count != clip.frame_count:
                relation = "shorter than" if info.frame_count < clip.frame_count else "longer than"
                return (f"its {kind.what[name]} {companions[name]} has {info.frame_count} frames, {relation} the "
                        f"clip's {clip.frame_count}: companions are made from the clip frame for frame")
        probe_media(companions["reference"])
        middle = clip.frame_count // 2
        target = read_frames(media, [0, middle], clip)
        motion = companions[kind.motion]
        motion_frames = read_frames(motion, [0, middle], probe_media(motion))
    except UnreadableMediaError as error:
        return f"its companion {error.path} cannot be read: {error.reason}"
    if all(_same_picture(t, p) for t, p in zip(target, motion_frames)):
        return (f"its {kind.what[kind.motion]} {motion} shows the clip itself, {kind.motion_is_not}: the model "
                f"would learn to copy its input (a near-zero loss that teaches nothing); {kind.how_to_make}")
    return None


def scan_animate_concepts(concepts, mode: str, kind: CompanionSet = ANIMATE) -> ScanResult:
    """The concept scan, with companions attached to each record (`companions`: name -> path or None), companion
    files dropped from the clips and `_mask` files read as replace masks instead of loss masks."""
    scanned = scan_concepts(concepts, companion=lambda path, media: is_companion(path, media, kind))
    result = ScanResult(skipped=list(scanned.skipped))
    manifests = {str(c.path): _manifest_companions(Path(c.path), kind) for c in concepts
                 if c.enabled and str(c.path).endswith(".jsonl") and Path(c.path).is_file()}
    for record in scanned.records:
        path = Path(record["path"])
        listed = manifests.get(str(record["concept"].path), {}).get(record["path"])
        companions = find_companions(path, listed, kind)
        if record.get("mask") is not None and companions.get("mask") is not None \
                and Path(record["mask"]) == companions["mask"]:
            record["mask"] = None   # the beside `_mask` file is the replace mask here
        problem = companion_problem(path, companions, mode, kind)
        if problem is not None:
            result.skip(path, problem)
            continue
        record["companions"] = {name: str(p) if p is not None and name in needed(mode, kind) else None
                                for name, p in companions.items()}
        result.records.append(record)
    return result
