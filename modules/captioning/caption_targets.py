"""Which files a caption run works on, which frames it shows the model, and how a caption is written.

A caption lives next to its media as `<stem><extension>` (what concept_scan reads for caption_source "sidecar").
A run is resumable because each caption is written (atomically) as soon as it is made: a run started again skips the
items that already have one unless told to overwrite.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modules.util.atomic import atomic_write_text
from modules.util.video_io import MEDIA_EXTENSIONS, media_kind


@dataclass(frozen=True)
class CaptionTarget:
    media: Path
    caption: Path

    @property
    def kind(self) -> str:
        """"image" or "video" (an .npz clip is a video): the word the prompt template gets as {kind}."""
        return "image" if media_kind(self.media) == "image" else "video"


def find_targets(folder: str | Path, extension: str = ".txt", recursive: bool = False) -> list[CaptionTarget]:
    """Every image, video and clip of `folder` (sorted), each with the caption file it gets."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder")
    pattern = "**/*" if recursive else "*"
    media = sorted(p for p in folder.glob(pattern) if p.is_file() and p.suffix.lower() in MEDIA_EXTENSIONS)
    return [CaptionTarget(path, path.with_suffix(extension)) for path in media]


def still_to_caption(targets: list[CaptionTarget], overwrite: bool) -> list[CaptionTarget]:
    """The targets a run captions: all when overwriting, else those without a non-empty caption file."""
    if overwrite:
        return list(targets)
    return [t for t in targets if not (t.caption.is_file() and t.caption.read_text(errors="replace").strip())]


def evenly_spaced(frame_count: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread over the clip, first and last included (fewer when the clip is shorter)."""
    if frame_count <= 0:
        raise ValueError("a clip without frames")
    if wanted <= 1 or frame_count == 1:
        return [frame_count // 2]
    return sorted({int(round(i)) for i in np.linspace(0, frame_count - 1, min(wanted, frame_count))})


def format_prompt(template: str, target: CaptionTarget, frames: int) -> str:
    """The template with {kind} (image / video), {name} (the file's stem) and {frames} filled in."""
    try:
        return template.format(kind=target.kind, name=target.media.stem, frames=frames)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(f"--prompt {template!r}: {error!r}; allowed fields are {{kind}}, {{name}}, {{frames}} "
                         f"(write {{{{ and }}}} for literal braces)") from error


def write_caption(target: CaptionTarget, text: str, prefix: str = "") -> str:
    """Writes prefix + the model's text (one line, surrounding whitespace removed) atomically; returns it."""
    caption = prefix + " ".join(text.split())
    atomic_write_text(target.caption, caption + "\n")
    return caption
