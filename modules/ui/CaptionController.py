"""The concept window's captioner: captions a concept's folder with a vision-language model in a worker thread (the
same code as `run-cmd.sh caption`), with progress, stop, and the loaded model kept for the next run. Imports no
toolkit: the view polls `progress` on its own loop."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from modules.captioning.caption_targets import find_targets, format_prompt, still_to_caption
from modules.captioning.QwenVLCaptioner import (DEFAULT_MODEL, DEFAULT_PROMPT, ModelNotAvailableError,
                                                QwenVLCaptioner, caption_folder)
from modules.ui.UIState import UIState

log = logging.getLogger(__name__)
CONCEPTS = "data.concepts"
# a refusal names the caption window's own field and tick box (CtkCaptionWindow), not the command line's flags
WINDOW_NAMES = {"model": "model", "allow": 'tick "allow downloading the model"'}


@dataclass
class CaptionSettings:
    model: str = DEFAULT_MODEL
    prompt: str = DEFAULT_PROMPT
    frames: int = 8
    prefix: str = ""
    overwrite: bool = False
    allow_download: bool = False
    batch_size: int = 1
    max_pixels: int = 448 * 448
    max_new_tokens: int = 160


@dataclass
class CaptionProgress:
    running: bool = False
    done: int = 0
    total: int = 0
    written: int = 0
    skipped: list[str] = field(default_factory=list)
    status: str = ""
    error: str = ""


class CaptionController:
    def __init__(self, state: UIState, index: int):
        self.state, self.index = state, index
        self.settings = CaptionSettings()
        self.progress = CaptionProgress()
        self._captioner: QwenVLCaptioner | None = None
        self._captioner_key: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def folder(self) -> Path:
        """The concept's folder; ValueError when the concept is a manifest or the folder does not exist."""
        path = Path(str(self.state.get(f"{CONCEPTS}.{self.index}.path") or ""))
        if not str(path) or str(path) == ".":
            raise ValueError(f"{CONCEPTS}.{self.index}.path is empty: choose the concept's folder first")
        if path.is_file():
            raise ValueError(f"{path}: a manifest; the captioner writes sidecar files next to a folder's media")
        if not path.is_dir():
            raise ValueError(f"{path}: not a folder")
        return path

    def targets(self):
        extension = self.state.get(f"{CONCEPTS}.{self.index}.caption_extension") or ".txt"
        recursive = bool(self.state.get(f"{CONCEPTS}.{self.index}.include_subdirectories"))
        return find_targets(self.folder(), extension, recursive)

    def plan(self) -> str:
        """What Start would do, in a line (or why it cannot)."""
        try:
            targets = self.targets()
        except ValueError as error:
            return str(error)
        todo = still_to_caption(targets, self.settings.overwrite)
        return f"{len(targets)} files, {len(targets) - len(todo)} with a caption; {len(todo)} to caption" + \
            (" (existing captions are replaced)" if self.settings.overwrite else " (existing captions are kept)")

    def start(self) -> bool:
        """Starts captioning in a worker thread; False (and progress.error) when the settings cannot work."""
        if self.progress.running:
            return False
        s = self.settings
        problems = [f"{name} must be at least 1" for name in ("frames", "batch_size", "max_new_tokens")
                    if getattr(s, name) < 1]
        todo = []
        try:
            targets = self.targets()
            todo = still_to_caption(targets, s.overwrite)
            if targets:
                format_prompt(s.prompt, targets[0], s.frames)
        except ValueError as error:
            problems.append(str(error))
        if problems:
            self.progress = CaptionProgress(error="\n".join(problems), status="refused")
            return False
        self._stop.clear()
        self.progress = CaptionProgress(running=True, total=len(todo), status="loading the model…")
        self._thread = threading.Thread(target=self._work, args=(todo,), name="captioner", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    def _load(self) -> QwenVLCaptioner:
        s = self.settings
        key = (s.model, s.allow_download, s.max_new_tokens)
        if self._captioner is None or self._captioner_key != key:
            self._captioner = None   # the old model is freed before the new one loads
            self._captioner = QwenVLCaptioner(s.model, allow_download=s.allow_download,
                                              max_new_tokens=s.max_new_tokens, names=WINDOW_NAMES)
            self._captioner_key = key
        return self._captioner

    def _work(self, todo) -> None:
        progress, s = self.progress, self.settings
        try:
            if todo:
                captioner = self._load()
                progress.status = "captioning…"

                def advance(done: int, total: int) -> None:
                    progress.done = done
                    progress.status = f"captioning… {done} / {total}"

                progress.written, progress.skipped = caption_folder(
                    captioner, todo, s.prompt, s.frames, s.max_pixels, s.batch_size, s.prefix, progress=advance,
                    stop=self._stop.is_set)
            stopped = " (stopped; Start continues with the rest)" if self._stop.is_set() else ""
            progress.status = f"wrote {progress.written} captions, {len(progress.skipped)} files skipped{stopped}"
        except ModelNotAvailableError as error:
            progress.error, progress.status = str(error), "refused"
        except Exception as error:  # noqa: BLE001  (shown in the window; the worker must end with a status)
            log.exception("captioning failed")
            progress.error, progress.status = f"{type(error).__name__}: {error}", "failed"
        finally:
            progress.running = False
