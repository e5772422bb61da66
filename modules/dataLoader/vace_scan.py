"""A clip's VACE companions, found before any model loads (docs/vace.md): beside `<stem>.<ext>`, the control
`<stem>_control.<video ext>` or a `<stem>_control/` folder of frames, and reference images `<stem>_ref.<image ext>`,
`<stem>_ref2...`, in that order; the mask is the clip's `<stem>_mask` (mask_scan.py: for a VACE model white =
generate). A manifest names them with `control_path` and `reference_paths` (a list). Companions beside a clip are
not training media."""
from __future__ import annotations

import re
from pathlib import Path

from modules.util.video_io import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, VIDEO_EXTENSIONS, frame_files

CONTROL_SUFFIX = "_control"
REFERENCE_SUFFIX = "_ref"
MANIFEST_CONTROL_KEYS = ("control_path", "control")
MANIFEST_REFERENCE_KEYS = ("reference_paths", "references")
_REFERENCE = re.compile(r"^(?P<stem>.+)_ref(?P<number>[0-9]*)$")


def _video_or_frames(folder: Path, stem: str) -> Path | None:
    """`folder/stem/` (a folder of frames) or `folder/stem.<video ext>`."""
    if (folder / stem).is_dir():
        return folder / stem
    for extension in sorted(VIDEO_EXTENSIONS):
        for candidate in (folder / f"{stem}{extension}", folder / f"{stem}{extension.upper()}"):
            if candidate.is_file():
                return candidate
    return None


def _holds_frames(folder: Path) -> bool:
    try:
        return bool(frame_files(folder))
    except OSError:   # a folder that cannot be listed holds no frames this run can read
        return False


def find_control(media: Path, control_folder: str | Path = "") -> Path | None:
    """`<stem>_control` beside the clip, else `<stem>` in the concept's `control_path` folder (musubi-tuner's
    control_directory, diffusion-pipe's control_path: the control named as the clip)."""
    beside = _video_or_frames(media.parent, f"{media.stem}{CONTROL_SUFFIX}")
    if beside is not None or not control_folder:
        return beside
    return _video_or_frames(Path(control_folder), media.stem)


def find_references(media: Path) -> list[Path]:
    """`<stem>_ref.png`, `<stem>_ref2.png`, ... in number order (`_ref` is the first); any image extension."""
    found = []
    for candidate in media.parent.glob(f"{media.stem}{REFERENCE_SUFFIX}*"):
        match = _REFERENCE.match(candidate.stem)
        if candidate.is_file() and candidate.suffix.lower() in IMAGE_EXTENSIONS and match \
                and match["stem"] == media.stem:
            found.append((int(match["number"] or 1), candidate))
    return [path for _, path in sorted(found)]


def is_beside_companion(path: Path, media: set[Path]) -> bool:
    """`path` is a control or reference of a media file beside it (then it is no clip of its own)."""
    stem = path.stem
    owners = []
    if stem.endswith(CONTROL_SUFFIX):
        owners.append(stem[:-len(CONTROL_SUFFIX)])
    if (match := _REFERENCE.match(stem)) is not None:
        owners.append(match["stem"])
    return any(other.parent == path.parent and other.stem in owners and other != path for other in media)


def manifest_companions(entry: dict, resolve) -> tuple[Path | None, list[Path] | None, str | None]:
    """(control, references, problem) of a manifest entry; `resolve` makes a manifest path a Path."""
    control = next((entry[k] for k in MANIFEST_CONTROL_KEYS if k in entry), None)
    if control is not None and (not isinstance(control, str) or not control):
        return None, None, f"its control_path is {control!r}, not a path"
    references = next((entry[k] for k in MANIFEST_REFERENCE_KEYS if k in entry), None)
    if isinstance(references, str):
        references = [references]
    if references is not None and (not isinstance(references, list)
                                   or not all(isinstance(r, str) and r for r in references)):
        return None, None, f"its reference_paths is {references!r}, not a list of paths"
    return (resolve(control) if control else None,
            [resolve(r) for r in references] if references is not None else None, None)


def companion_problem(control: Path | None, references: list[Path]) -> str | None:
    """Why the item cannot train with these companions (a missing file, a reference that is no image), or None."""
    if control is not None and not control.exists():
        return f"its control {control} does not exist"
    if control is not None and control.is_dir() and not _holds_frames(control):
        return f"its control {control} is a folder without frames ({', '.join(sorted(IMAGE_EXTENSIONS))})"
    if control is not None and not control.is_dir() and not control.is_file():
        return f"its control {control} is not a regular file (a FIFO, device or socket, or a link to one)"
    if control is not None and control.is_file() and control.suffix.lower() not in MEDIA_EXTENSIONS:
        return f"its control {control} is no video or image ({', '.join(sorted(VIDEO_EXTENSIONS))}, or frames)"
    for reference in references:
        if not reference.is_file():
            return f"its reference image {reference} does not exist"
        if reference.suffix.lower() not in IMAGE_EXTENSIONS:
            return f"its reference {reference} is not an image ({', '.join(sorted(IMAGE_EXTENSIONS))})"
    return None
