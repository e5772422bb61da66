"""The concept window's dataset viewer and caption editor: every item of a concept with its frames, fps, resolution
bucket and skip reason (from the data loader's own scan, probe and bucketing: what training would do), its caption
and the caption file. Imports no toolkit.

Saving a caption rewrites the sidecar file atomically. The text cache is keyed by the caption's content
(EncodeText.key = hash of the prompt and the text encoder), so the next run's caching finds no entry for the new
text and encodes it; the old entry is simply not asked for again (tests/test_dataset_browser.py proves it on a real
loader).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modules.util.atomic import atomic_write_text


@dataclass
class DatasetItem:
    path: str
    caption: str = ""
    caption_file: str = ""          # the sidecar the editor writes ("" when the concept's captions are not files)
    frames: int = 0
    fps: float | None = None
    width: int = 0
    height: int = 0
    bucket: str = ""                # "<frames> x <width>x<height>" as the run plan writes it (the first window)
    skip_reason: str = ""
    # a control model's companions (ItemCompanions.py): VACE control / mask / references, Animate pose / face / ...
    companions: list = field(default_factory=list)

    @property
    def skipped(self) -> bool:
        return bool(self.skip_reason)


def browse(config, index: int, variant=None) -> list[DatasetItem]:
    """The items of concept `index` of `config` (a TrainConfig), kept and skipped, in file order. `variant`: the
    model's (ItemCompanions.viewer_variant); a VACE or Animate model's items carry their companions, found as
    training finds them."""
    from modules.dataLoader.pipeline.Pipeline import Pipeline
    from modules.dataLoader.WanBaseDataLoader import DataError, WanBaseDataLoader
    from modules.ui.ItemCompanions import companions_of, kind_of

    concept = config.data.concepts[index].model_copy(update={"enabled": True})
    config = config.model_copy(update={"data": config.data.model_copy(update={"concepts": [concept]}),
                                       "e2v": config.e2v.model_copy(update={"dataset_config": "", "datasets": []})})
    loader = WanBaseDataLoader(config, variant)
    kind = kind_of(variant)
    items: dict[str, DatasetItem] = {}
    try:
        loader.scan()
    except DataError:
        pass   # nothing usable: every file is listed below with its skip reason
    sidecar = concept.caption_source == "sidecar"
    for record in loader.scan_result.records:
        path = record["path"]
        items[path] = DatasetItem(path, caption=record["caption"],
                                  caption_file=str(Path(path).with_suffix(concept.caption_extension)) if sidecar
                                  else "",
                                  companions=companions_of(path, kind, record, concept, config.animate.mode,
                                                             config.data.control.derive, variant))
    names = ["path", "media_info", "frame_bucket", "resolution_bucket"]
    pipeline = Pipeline(loader._item_modules(), config.seed, outputs=names)
    pipeline.start_epoch(0)
    for row_index in range(len(pipeline)):
        row = pipeline.get_item(row_index)
        item = items.get(row["path"])
        if item is None or item.bucket:
            continue   # a concept's repeats: the first window stands for the item
        info = row["media_info"]
        height, width = row["resolution_bucket"]
        item.frames, item.fps, item.width, item.height = info.frame_count, info.fps, info.width, info.height
        item.bucket = f"{row['frame_bucket']} x {width}x{height}"
    for path, reason in list(loader.scan_result.skipped) + list(pipeline.skipped):
        item = items.setdefault(str(path), DatasetItem(
            str(path), companions=companions_of(str(path), kind, None, concept, config.animate.mode,
                                     variant=variant)))
        item.skip_reason = reason
    return sorted(items.values(), key=lambda item: item.path)


def select(items: list[DatasetItem], text: str = "", bucket: str = "", skipped: bool | None = None) \
        -> list[DatasetItem]:
    """Search by caption text (case-insensitive, every word), filter by bucket and by skipped."""
    words = text.lower().split()
    return [item for item in items
            if all(word in item.caption.lower() for word in words)
            and (not bucket or item.bucket == bucket)
            and (skipped is None or item.skipped == skipped)]


def save_caption(item: DatasetItem, text: str) -> None:
    """Writes the caption file next to the clip atomically (a crash leaves the old caption or the new one)."""
    if not item.caption_file:
        raise ValueError(f"{item.path}: the concept's captions do not come from sidecar files (caption_source); "
                         f"edit the file name or the prompt file instead")
    atomic_write_text(item.caption_file, text.strip() + "\n")
    item.caption = text.strip()


def thumbnails(item: DatasetItem) -> list[np.ndarray]:
    """The first, middle and last frame (uint8 (H, W, 3)); one for an image."""
    from modules.util.video_io import read_frames
    if item.skipped or not item.frames:
        return []
    picks = sorted({0, item.frames // 2, item.frames - 1})
    return list(read_frames(item.path, picks))

