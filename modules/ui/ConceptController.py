"""The concepts tab: the concept list and each concept's statistics, computed by the data loader's own scan and
probe (no model is loaded, nothing is decoded but a few thumbnails). Imports no toolkit; `statistics` is slow on a
large folder, so the view runs it in a worker thread and shows the result through `after`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modules.ui.UIState import UIState

CONCEPTS = "data.concepts"


@dataclass
class ConceptStatistics:
    clips: int = 0
    images: int = 0
    frames_per_bucket: dict[int, int] = field(default_factory=dict)        # frame bucket -> items
    resolution_buckets: dict[str, int] = field(default_factory=dict)       # "HxW" -> items
    skipped: list[tuple[str, str]] = field(default_factory=list)          # (file, reason)
    thumbnails: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (file, uint8 (H, W, 3))
    error: str = ""


class ConceptController:
    def __init__(self, state: UIState):
        self.state = state

    def concepts(self) -> list[dict]:
        return list(self.state.get(CONCEPTS) or [])

    def add(self, path: str = "") -> int:
        from modules.util.config.DataConfig import ConceptConfig
        concept = ConceptConfig(name=Path(path).name if path else "", path=path)
        return self.state.list_append(CONCEPTS, concept.model_dump(mode="json"))

    def remove(self, index: int) -> None:
        self.state.list_remove(CONCEPTS, index)

    def title(self, index: int) -> str:
        concept = self.concepts()[index]
        return concept.get("name") or Path(concept.get("path") or "").name or f"concept {index}"

    def statistics(self, index: int, thumbnails: int = 4, config=None) -> ConceptStatistics:
        """Runs WanBaseDataLoader.scan() on this concept alone with the current data settings (`config`: built by
        the caller on the main loop when this runs in a worker, so the worker never reads UIState while it
        changes)."""
        from modules.dataLoader.WanBaseDataLoader import DataError, WanBaseDataLoader
        from modules.util.config.config_io import ConfigError
        from modules.util.video_io import read_frames, UnreadableMediaError
        from modules.modelLoader.wan.parts.model_plan import detect_model_variant
        from modules.util.wan_detection import NotAWanModelError

        if config is None:
            try:
                config = self.state.config()
            except ConfigError as error:
                return ConceptStatistics(error="\n".join(error.problems))
        concept = config.data.concepts[index].model_copy(update={"enabled": True})
        if not Path(concept.path).exists():
            return ConceptStatistics(error=f"data.concepts.{index}.path: {concept.path!r} does not exist")
        config = config.model_copy(update={"data": config.data.model_copy(update={"concepts": [concept]}),
                                           "e2v": config.e2v.model_copy(update={"dataset_config": "",
                                                                                "datasets": []})})
        base = Path(config.model.base_model_name)
        try:
            variant = detect_model_variant(config.model) if base.is_dir() else None
        except NotAWanModelError:
            variant = None
        loader = WanBaseDataLoader(config, variant)
        result = ConceptStatistics()
        try:
            loader.scan()
        except DataError as error:
            result.error = str(error)
            result.skipped = list(loader.scan_result.skipped)
            return result
        stats = loader.statistics()
        counts = next(iter(stats.per_concept.values()), {})
        result.clips, result.images = counts.get("clips", 0), counts.get("images", 0)
        for (frames, height, width), count in sorted(stats.buckets.items()):
            result.frames_per_bucket[frames] = result.frames_per_bucket.get(frames, 0) + count
            key = f"{height}x{width}"
            result.resolution_buckets[key] = result.resolution_buckets.get(key, 0) + count
        result.skipped = stats.skipped
        for path in stats.paths[:thumbnails]:
            try:
                result.thumbnails.append((path, read_frames(path, [0])[0]))
            except (UnreadableMediaError, IndexError, ValueError):
                continue
        return result
