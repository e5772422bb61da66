"""The sampling tab: the sample list editor (the samples file of `sampling.samples_file`) and the preview player's
model: which preview videos exist per prompt and at which steps, and their frames decoded with PyAV
(modules/util/video_io). Imports no toolkit.

Previews are the files TrainingSampler writes: <workspace>/samples/<index>-<slug>/<step>-<epoch>.mp4.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modules.ui.UIState import UIState
from modules.util.config.SampleConfig import SampleConfig
from modules.util.sample_definitions import (SampleDefinitionError, is_samples_json, load_sample_definitions,
                                             save_samples_json)

# <step>-<epoch>.mp4, and <step>-<epoch>-x<strength>.mp4 for sampling.compare_strengths
PREVIEW_NAME = re.compile(r"^(\d+)-(\d+)(?:-x(-?\d+(?:\.\d+)?))?\.mp4$")
# the columns of the sample list editor; the rest of SampleConfig's fields keep their values
EDITOR_FIELDS = ("enabled", "prompt", "negative_prompt", "width", "height", "frames", "seed", "steps", "guidance",
                 "image", "elements")
# the columns a control or character model's samples add (SampleConfig's fields; docs/vace.md, docs/animate.md)
CONDITION_FIELDS = {"vace": ("control_video", "mask_video", "reference_images", "control_scale"),
                    "fun": ("control_video", "mask_video"),   # image: the start image; a mask where it takes one
                    "animate": ("reference_image", "pose_video", "face_video", "background_video", "mask_video",
                                "animate_mode"),
                    "animate_2": ("reference_image", "driving_video")}


def editor_fields(kind: str = "") -> tuple[str, ...]:
    """The sample list's columns for a model kind ('vace', 'fun', 'animate' or '': ItemCompanions.kind_of; 'animate_2'
    for Animate-2, whose samples take a driving video instead of Animate's pose and face videos)."""
    return EDITOR_FIELDS + CONDITION_FIELDS.get(kind, ())


def variant_editor_fields(variant) -> tuple[str, ...]:
    """The sample list's columns for a model's variant (None: not known): a control model's mask video column only
    where the variant takes one (`takes_control_mask`: not Wan2.1-Fun Control)."""
    from modules.ui.ItemCompanions import kind_of
    kind = "animate_2" if variant is not None and variant.takes_driving_video else kind_of(variant)
    fields = editor_fields(kind)
    if kind in ("vace", "fun") and not variant.takes_control_mask:
        fields = tuple(name for name in fields if name != "mask_video")
    return fields


# the accelerator fields the sampling tab shows (sampling.accelerator, docs/distilled.md); timesteps (empty: evenly
# spaced by steps) and shift come last, LightX2V's unless set
ACCELERATOR_FIELDS = ("file", "file_2", "strength", "steps", "timesteps", "shift")


def accelerator_fields(variant) -> tuple[str, ...]:
    """The accelerator fields shown for a model's variant (None: not known): the low-noise expert's file only for a
    two-expert (A14B) model."""
    if variant is not None and variant.has_two_experts:
        return ACCELERATOR_FIELDS
    return tuple(name for name in ACCELERATOR_FIELDS if name != "file_2")


def preview_settings(path: str | Path) -> dict:
    """The settings a preview (or sampled video) was made with: the `<video>.json` beside it; {} when there is none
    or it cannot be read (a preview being written)."""
    import json
    try:
        settings = json.loads(Path(path).with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def run_label(settings: dict) -> str:
    """"4 steps, accelerated" for a video its settings say an accelerator made, "" for the others."""
    if not settings.get("accelerator"):
        return ""
    steps = settings.get("steps") or settings["accelerator"].get("steps")
    return f"{steps} steps, accelerated"


def epoch_text(step: int, epoch: int) -> str:
    """The epoch a preview was made in, counted from 1 as the progress bar counts (file names keep the trainer's
    0-based epoch); a preview made before the first step says so."""
    return "before training" if step == 0 else f"epoch {epoch + 1}"


@dataclass
class PreviewVideo:
    path: Path
    step: int
    epoch: int

    def label(self) -> str:
        """How it ran, where that differs from the sample's own settings ("4 steps, accelerated"); reads its JSON."""
        return run_label(preview_settings(self.path))


@dataclass
class PreviewSeries:
    folder: Path                        # <index>-<slug>
    index: int
    videos: list[PreviewVideo] = field(default_factory=list)   # by step
    strength: str = ""                  # sampling.compare_strengths: the LoRA strength of these previews

    @property
    def name(self) -> str:
        return self.folder.name + (f" (LoRA x{self.strength})" if self.strength else "")

    @property
    def newest(self) -> PreviewVideo:
        return self.videos[-1]


class PreviewPlayer:
    """Frames of one video and a play position; the view calls `tick()` every 1/fps seconds."""

    def __init__(self):
        self.frames: np.ndarray | None = None
        self.fps = 16.0
        self.index = 0
        self.playing = True
        self.loop = True
        self.path: Path | None = None

    @staticmethod
    def read(path: str | Path) -> tuple[np.ndarray, float]:
        """(frames uint8 (F, H, W, 3), fps); thread-safe, so a view can decode off its main loop."""
        from modules.util.video_io import probe_media, read_media

        info = probe_media(path)
        return read_media(path), info.fps or 16.0

    def show(self, path: str | Path, frames: np.ndarray, fps: float) -> None:
        self.frames, self.fps, self.path, self.index = frames, fps, Path(path), 0

    def open(self, path: str | Path) -> None:
        self.show(path, *self.read(path))

    @property
    def frame(self) -> np.ndarray | None:
        return None if self.frames is None else self.frames[self.index]

    def tick(self) -> bool:
        """Advances one frame when playing; False when nothing changed (paused, or at the end without loop)."""
        if self.frames is None or not self.playing:
            return False
        if self.index + 1 < len(self.frames):
            self.index += 1
        elif self.loop:
            self.index = 0
        else:
            self.playing = False
            return False
        return True

    @property
    def interval_ms(self) -> int:
        return max(15, round(1000 / self.fps))


class SamplingController:
    def __init__(self, state: UIState):
        self.state = state
        self.samples: list[dict] = []
        self.problem = ""

    # ---- the sample list -----------------------------------------------------------------------------------------

    def samples_file(self) -> Path:
        """The configured samples file; when none is set, <workspace>/samples.json (set on the first save)."""
        configured = self.state.get("sampling.samples_file") or ""
        return Path(configured) if configured else Path(self.state.get("workspace_dir") or "workspace") / \
            "samples.json"

    def load_samples(self) -> list[dict]:
        self.problem = ""
        path = self.samples_file()
        self.samples = []
        if path.is_file():
            try:
                self.samples = [s.model_dump(mode="json") for s in load_sample_definitions(path)]
            except SampleDefinitionError as error:
                self.problem = str(error)
        return self.samples

    def add_sample(self) -> int:
        self.samples.append(SampleConfig(prompt="", width=832, height=480).model_dump(mode="json"))
        return len(self.samples) - 1

    def remove_sample(self, index: int) -> None:
        del self.samples[index]

    def set_field(self, index: int, name: str, value) -> str | None:
        """Sets one field of sample `index`; the message when the value is not allowed (nothing is changed)."""
        from pydantic import ValidationError

        candidate = dict(self.samples[index], **{name: value})
        try:
            SampleConfig(**candidate)
        except ValidationError as error:
            return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        self.samples[index] = candidate
        return None

    def save_samples(self) -> Path:
        """Writes the list as a samples JSON file (a musubi-style .txt prompt file becomes the .json beside it) and
        points sampling.samples_file at it."""
        path = self.samples_file()
        if path.is_file() and not is_samples_json(path, path.read_text(encoding="utf-8-sig")):
            path = path.with_suffix(".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_samples_json([SampleConfig(**sample) for sample in self.samples], path)
        if self.state.get("sampling.samples_file") != str(path):
            self.state.set("sampling.samples_file", str(path))
        return path

    # ---- previews ------------------------------------------------------------------------------------------------

    def samples_dir(self) -> Path:
        """The newest run's previews: GenericTrainer writes each run's into <workspace>/samples/<run>/<prompt>/
        (a folder that holds only prompt folders of videos is read as it is)."""
        root = Path(self.state.get("workspace_dir") or "workspace") / "samples"
        runs = [d for d in root.iterdir() if d.is_dir() and any(c.is_dir() for c in d.iterdir())] \
            if root.is_dir() else []
        return max(runs, key=lambda d: d.stat().st_mtime) if runs else root

    def locate(self, path: str | Path) -> tuple[list[PreviewSeries], PreviewSeries, int] | None:
        """A preview chosen elsewhere (a gallery cell, of any run): the series of its run, the one holding it and
        its index there; None for a video that is no training preview (a comparison grid)."""
        path = Path(path)
        series = self.previews(path.parent.parent)
        for one in series:
            for index, video in enumerate(one.videos):
                if video.path == path:
                    return series, one, index
        return None

    def previews(self, root: Path | None = None) -> list[PreviewSeries]:
        """Every prompt folder of a run (default: the newest) with its preview videos sorted by training step;
        previews at other LoRA strengths (sampling.compare_strengths) are series of their own after the folder's."""
        root = self.samples_dir() if root is None else root
        if not root.is_dir():
            return []
        series = []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            head = folder.name.split("-", 1)[0]
            if not head.isdigit():
                continue
            by_strength: dict[str, list[PreviewVideo]] = {}
            for video in folder.glob("*.mp4"):
                match = PREVIEW_NAME.match(video.name)
                if match:
                    by_strength.setdefault(match[3] or "", []).append(PreviewVideo(video, int(match[1]), int(match[2])))
            for strength in sorted(by_strength, key=lambda s: (s != "", float(s) if s else 0.0)):
                videos = sorted(by_strength[strength], key=lambda v: (v.step, v.epoch))
                series.append(PreviewSeries(folder, int(head), videos, strength))
        return series

    def references(self, series: PreviewSeries) -> dict[str, str]:
        """E2V: the element images of the sample that made these previews (name -> path), from the samples
        file; empty for other samples."""
        try:
            samples = load_sample_definitions(self.samples_file())
        except SampleDefinitionError:
            return {}
        if series.index >= len(samples):
            return {}
        return {name: path for name, path in samples[series.index].elements.items() if Path(path).is_file()}

    def driving_video(self, series: PreviewSeries) -> str:
        """The control (VACE), pose (Animate) or driving (Animate-2) video of the sample that made these previews,
        from the samples file, when it exists; "" otherwise. The player shows it beside the preview, frame by
        frame."""
        try:
            samples = load_sample_definitions(self.samples_file())
        except SampleDefinitionError:
            return ""
        if series.index >= len(samples):
            return ""
        sample = samples[series.index]
        path = sample.control_video or sample.pose_video or sample.driving_video
        return path if path and Path(path).exists() else ""
