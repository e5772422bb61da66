from __future__ import annotations

import os
import threading
from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.util.video_io import MediaInfo, UnreadableMediaError, probe_media


class ProbeMedia(PipelineModule):
    """Probes each file (frame times, size) without decoding it: produces 'media_info' (a MediaInfo, None when the
    file is unusable) and 'media_error' (the reason, None when usable).

    Results are kept for the module's lifetime, keyed by (path, size, mtime), so later epochs do not probe again
    while a changed file is probed afresh."""

    def __init__(self, path_name: str = "path", name: str | None = None):
        super().__init__(name)
        self.path_name = path_name
        self._cache: dict[tuple[str, int, int], tuple[MediaInfo | None, str | None]] = {}
        self._lock = threading.Lock()

    def needs(self) -> list[str]:
        return [self.path_name]

    def produces(self) -> list[str]:
        return ["media_info", "media_error"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        path = str(ctx.get(self.path_name, index))
        info, error = self.probe(path)
        return {"media_info": info, "media_error": error}

    def probe(self, path: str) -> tuple[MediaInfo | None, str | None]:
        try:
            stat = os.stat(path)
        except OSError as error:
            return None, f"cannot read the file ({error.strerror or error})"
        key = (path, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            result: tuple[MediaInfo | None, str | None] = (probe_media(path), None)
        except UnreadableMediaError as error:
            result = (None, error.reason)
        with self._lock:
            self._cache[key] = result
        return result
