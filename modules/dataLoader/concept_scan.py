"""Turns the configured concepts into records (media path, concept, caption) before any model loads. Files that
cannot be used are skipped with one warning each and counted."""
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.config.DataConfig import ConceptConfig
from modules.util.video_io import MEDIA_EXTENSIONS

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
    sidecar = media.with_suffix(".txt")
    if sidecar.is_file():
        return sidecar.read_text(encoding="utf-8").strip()
    return None


def _folder_media(folder: Path, recursive: bool) -> list[Path]:
    pattern = "**/*" if recursive else "*"
    return sorted(p for p in folder.glob(pattern) if p.is_file() and p.suffix.lower() in MEDIA_EXTENSIONS)


def _manifest_media(manifest: Path, result: ScanResult) -> list[tuple[Path, str | None]]:
    """jsonl: one object a line with a media path (relative to the manifest) and a prompt or caption."""
    entries = []
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            result.skip(f"{manifest}:{number}", f"not a JSON object ({e.msg})")
            continue
        media = next((entry[k] for k in ("path", "media", "video", "file", "clip") if k in entry), None)
        if not isinstance(entry, dict) or media is None:
            result.skip(f"{manifest}:{number}", "no media path (keys: path, media, video, file or clip)")
            continue
        caption = next((entry[k] for k in ("prompt", "caption", "text") if k in entry), None)
        entries.append(((manifest.parent / media), caption))
    return entries


def scan_concepts(concepts: list[ConceptConfig]) -> ScanResult:
    result = ScanResult()
    for concept in concepts:
        if not concept.enabled:
            continue
        root = Path(concept.path)
        prompt_text = Path(concept.prompt_path).read_text(encoding="utf-8").strip() \
            if concept.caption_source == "prompt_file" else None
        if root.is_file() and root.suffix == ".jsonl":
            entries = [(path, caption if caption is not None else _caption_for(path, concept, prompt_text))
                       for path, caption in _manifest_media(root, result)]
        else:
            entries = [(path, _caption_for(path, concept, prompt_text))
                       for path in _folder_media(root, concept.include_subdirectories)]
        for path, caption in entries:
            if not path.is_file():
                result.skip(path, "file does not exist")
            elif caption is None and concept.caption_required:
                result.skip(path, f"no caption ({path.with_suffix('.txt').name} is missing)")
            else:
                result.records.append({"path": str(path), "concept": concept, "caption": caption or ""})
    return result
