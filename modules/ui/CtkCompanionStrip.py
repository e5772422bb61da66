"""One dataset item beside its companions (modules/ui/ItemCompanions.py): target, control, mask and references
(VACE) or target, pose, face, reference, background and mask (Animate), each at the frame of one shared slider; a
missing companion is a grey panel that says so. Frames are decoded in a worker thread (the newest request wins),
so dragging the slider never blocks the window."""
from __future__ import annotations

import customtkinter as ctk

from modules.ui.ctk_components import ERROR_COLOR, in_worker, thumbnail_image
from modules.ui.ItemCompanions import Companion, frames_at

PANEL = 150


class CtkCompanionStrip:
    def __init__(self, master, row: int = 0, column: int = 0, columnspan: int = 1, panel: int = PANEL):
        self.frame = ctk.CTkFrame(master, fg_color="transparent")
        self.frame.grid(row=row, column=column, columnspan=columnspan, sticky="w", padx=6, pady=4)
        self.panel = panel
        self.panels = ctk.CTkFrame(self.frame, fg_color="transparent")
        self.panels.grid(row=0, column=0, sticky="w")
        bar = ctk.CTkFrame(self.frame, fg_color="transparent")
        bar.grid(row=1, column=0, sticky="w", pady=(4, 0))
        ctk.CTkLabel(bar, text="frame").grid(row=0, column=0, padx=(0, 6))
        self.slider = ctk.CTkSlider(bar, from_=0, to=1, number_of_steps=1, width=360, command=self._slid)
        self.slider.grid(row=0, column=1)
        self.frame_label = ctk.CTkLabel(bar, text="", width=80, anchor="w")
        self.frame_label.grid(row=0, column=2, padx=6)
        self.target: str | None = None
        self.companions: list[Companion] = []
        self.frames = 0
        self.index = 0
        self.shown: dict[str, object] = {}      # role -> the frame (ndarray) or message on screen (tests read it)
        self.shown_index = -1
        self.boxes: dict = {}   # column -> the panel written in place of a frame (its text: tests read it)
        self._images = []
        self._wanted: tuple | None = None
        self._busy = False

    def show(self, target: str | None, companions: list[Companion], frames: int) -> None:
        """Shows item `target` (None: nothing) with its companions, from its first frame."""
        self.target, self.companions, self.frames = target, list(companions), max(1, frames)
        self.slider.configure(to=max(1, self.frames - 1), number_of_steps=max(1, self.frames - 1))
        self.slider.set(0)
        self.slider.configure(state="normal" if self.frames > 1 else "disabled")
        self.set_frame(0)

    def set_frame(self, index: int) -> None:
        self.index = max(0, min(int(index), self.frames - 1))
        self.slider.set(self.index)   # set from code (the screenshots, a test): the handle shows it too
        self.frame_label.configure(text=f"{self.index + 1} / {self.frames}")
        if self.target is None:
            self._draw({})
            return
        self._wanted = (self.target, tuple(self.companions), self.index)
        if not self._busy:
            self._decode()

    def _slid(self, value: float) -> None:
        if round(value) != self.index:
            self.set_frame(round(value))

    def _decode(self) -> None:
        wanted, self._wanted = self._wanted, None
        self._busy = True

        def show(frames):
            self._busy = False
            if self._wanted is not None:   # the slider moved on meanwhile: decode the newest frame
                self._decode()
                return
            self.shown_index = wanted[2]
            self._draw(frames if not isinstance(frames, Exception) else {"target": f"cannot be shown: {frames}"})

        target, companions, index = wanted
        in_worker(self.frame, lambda: frames_at(target, list(companions), index), show, "companion-frames", 30)

    def _draw(self, frames: dict) -> None:
        for child in self.panels.winfo_children():
            child.destroy()
        self._images = []
        self.boxes = {}
        self.shown = dict(frames)
        roles = [("target", self.target)] + [(c.role, c) for c in self.companions] if self.target else []
        for column, (role, companion) in enumerate(roles):
            ctk.CTkLabel(self.panels, text=role, anchor="w").grid(row=0, column=column, sticky="w", padx=3)
            shown = frames.get(role)
            if isinstance(companion, Companion) and companion.missing:
                self.shown[role] = companion.text
                self._box(column, companion.missing_text, "#555555")
            elif shown is None:
                self._box(column, "…", "#333333")
            elif isinstance(shown, str):
                self._box(column, shown, ERROR_COLOR)
            else:
                picture = thumbnail_image(shown, self.panel)
                self._images.append(picture)
                ctk.CTkLabel(self.panels, image=picture, text="").grid(row=1, column=column, padx=3)

    def _box(self, column: int, text: str, colour: str) -> None:
        box = ctk.CTkLabel(self.panels, text=text, width=self.panel, height=self.panel, fg_color=colour,
                           text_color="#eeeeee", wraplength=self.panel - 10)
        box.grid(row=1, column=column, padx=3)
        self.boxes[column] = box
