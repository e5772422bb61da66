"""Turns the configured concepts into records (media path, concept, caption) before any model loads. Files that
cannot be used are skipped with one warning each and counted."""
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.config.DataConfig import ConceptConfig
from modules.util.config.E2VConfig import strip_llm_caption_prefix
from modules.util.text_encoding import read_text_file  # noqa: F401 (imported from here by other modules)
from modules.dataLoader.mask_scan import find_mask, is_beside_mask, mask_is_black
from modules.dataLoader.vace_scan import (companion_problem, find_control, find_references, is_beside_companion,
                                          manifest_companions)
from modules.util.video_io import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, UnreadableMediaError, frame_files

log = logging.getLogger(__name__)


@dataclass
class ScanResult:
    records: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    def skip(self, path, reason: str) -> None:
        log.warning("skipping %s: %s", path, reason)
        self.skipped.append((str(path), reason))


def _caption_for(media: Path, concept: ConceptConfig, prompt_file_text: str | None) -> str | None:
    if concept.caption_source == "filename":
        return media.stem.replace("_", " ")
    if concept.caption_source == "prompt_file":
        return prompt_file_text
    sidecar = media.with_suffix(concept.caption_extension)
    if sidecar.is_file():
        return read_text_file(sidecar).strip()
    return None


def _folder_media(folder: Path, recursive: bool, frame_folders: bool = False, companion=None) -> list[Path]:
    """The media files of a concept folder, and anything else named as one (a FIFO, a link to a device: skipped
    with a warning later, not dropped unseen); with `frame_folders` also its sub-folders that hold images, each one
    clip (musubi-tuner's video_directory). Not the masks beside clips, nor files that belong to a clip (VACE's
    control and references; `companion(path, media)`: Animate's pose / face / reference videos)."""
    pattern = "**/*" if recursive else "*"
    media = {p for p in folder.glob(pattern) if not p.is_dir() and p.suffix.lower() in MEDIA_EXTENSIONS}

    def belongs_to_a_clip(p: Path) -> bool:
        return is_beside_mask(p, media) or is_beside_companion(p, media) or bool(companion and companion(p, media))

    found = [p for p in media if not belongs_to_a_clip(p)]
    if frame_folders:
        found += [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and frame_files(p)
                  and not belongs_to_a_clip(p)]
    return sorted(found)


MANIFEST_MEDIA_KEYS = ("path", "media", "video", "file", "clip", "video_path", "image_path")
MANIFEST_CAPTION_KEYS = ("prompt", "caption", "text")
MANIFEST_MASK_KEYS = ("mask_path", "mask")


def manifest_entry_path(manifest: Path, media: str) -> Path:
    """A relative path in a manifest names a file beside the manifest; when there is none, the file at that path
    from the current directory (where a preprocessing script run from the project folder, or musubi-tuner's
    metadata.jsonl, means it). An absolute path is used as it is."""
    beside = manifest.parent / media
    if Path(media).is_absolute() or beside.exists() or not Path(media).exists():
        return beside
    return Path(media)


def _manifest_media(manifest: Path, result: ScanResult) -> list[tuple[Path, str | None, Path | None, tuple]]:
    """jsonl: one object a line with a media path (see manifest_entry_path), a prompt or caption and optionally a
    loss mask (`mask_path`) and VACE companions (`control_path`, `reference_paths`: vace_scan.py)."""
    entries = []
    for number, line in enumerate(read_text_file(manifest).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            result.skip(f"{manifest}:{number}", f"not a JSON object ({e.msg})")
            continue
        if not isinstance(entry, dict):
            result.skip(f"{manifest}:{number}", f"not a JSON object but a {type(entry).__name__} ({line.strip()[:40]})")
            continue
        media = next((entry[k] for k in MANIFEST_MEDIA_KEYS if k in entry), None)
        if not isinstance(media, str) or not media:
            result.skip(f"{manifest}:{number}", f"no media path (keys: {', '.join(MANIFEST_MEDIA_KEYS)})")
            continue
        caption = next((entry[k] for k in MANIFEST_CAPTION_KEYS if k in entry), None)
        if caption is not None and not isinstance(caption, str):
            result.skip(f"{manifest}:{number}", f"its caption is a {type(caption).__name__}, not text")
            continue
        caption = caption.removeprefix("\ufeff") if caption is not None else None
        mask = next((entry[k] for k in MANIFEST_MASK_KEYS if k in entry), None)
        if mask is not None and (not isinstance(mask, str) or not mask):
            result.skip(f"{manifest}:{number}", f"its mask_path is {mask!r}, not a path")
            continue
        control, references, problem = manifest_companions(entry, lambda path: manifest_entry_path(manifest, path))
        if problem:
            result.skip(f"{manifest}:{number}", problem)
            continue
        entries.append((manifest_entry_path(manifest, media), caption,
                        manifest_entry_path(manifest, mask) if mask else None, (control, references)))
    return entries


def _mask_problem(mask: Path) -> str | None:
    """Why the item of this mask cannot train (the mask is missing, unreadable or black everywhere), or None."""
    if not mask.is_file():
        return f"its mask {mask} does not exist"
    try:
        black = mask_is_black(mask)
    except UnreadableMediaError as error:
        return f"its mask {mask} cannot be read: {error.reason}"
    return f"its mask {mask} is black everywhere: the item would carry no loss" if black else None


def scan_concepts(concepts: list[ConceptConfig], companion=None) -> ScanResult:
    result = ScanResult()
    for concept in concepts:
        if not concept.enabled:
            continue
        root = Path(concept.path)
        prompt_text = read_text_file(concept.prompt_path).strip() if concept.caption_source == "prompt_file" else None
        if root.is_file() and root.suffix.lower() == ".jsonl":
            entries = [(path, caption if caption is not None else _caption_for(path, concept, prompt_text),
                        mask or find_mask(path, concept), companions)
                       for path, caption, mask, companions in _manifest_media(root, result)]
        else:
            entries = [(path, _caption_for(path, concept, prompt_text), find_mask(path, concept), (None, None))
                       for path in _folder_media(root, concept.include_subdirectories, concept.frame_folders,
                                                 companion)]
        for path, caption, mask, (control, references) in entries:
            control = control or find_control(path, concept.control_path)
            references = find_references(path) if references is None else references
            # musubi-tuner's video_path (and video_directory) may name a folder of frames: one clip, its images in
            # name order
            frames_folder = path.is_dir() and (root.is_file() or concept.frame_folders)
            if frames_folder and not frame_files(path):
                result.skip(path, f"a folder of frames needs images ({', '.join(sorted(IMAGE_EXTENSIONS))}); "
                                  f"it has none")
            elif not frames_folder and not path.is_file():
                result.skip(path, "not a regular file (a FIFO, device or socket, or a link to one): it cannot be "
                                  "read as media" if path.exists() else "file does not exist")
            elif caption is None and concept.caption_required:
                result.skip(path, f"no caption ({path.with_suffix(concept.caption_extension).name} is missing)")
            elif mask is None and concept.mask_required:
                result.skip(path, "no mask (the concept's mask_required: a <name>_mask file beside it, or one in "
                                  "mask_path)")
            elif mask is not None and (problem := _mask_problem(mask)):
                result.skip(path, problem)
            elif problem := companion_problem(control, references):
                result.skip(path, problem)
            else:
                caption = caption or ""
                if concept.remove_common_llm_caption_prefixes:
                    caption = strip_llm_caption_prefix(caption)
                result.records.append({"path": str(path), "concept": concept, "caption": caption,
                                       "mask": None if mask is None else str(mask),
                                       "control": None if control is None else str(control),
                                       "references": tuple(str(r) for r in references),
                                       "reference_count": len(references)})
    return result
