"""The concept window's "Caption with a model…": the captioner's settings, Start / Stop, a progress bar and what was
written (the work runs in CaptionController's worker thread; this window polls it)."""
from __future__ import annotations

import customtkinter as ctk

from modules.ui.CaptionController import CaptionController
from modules.ui.ctk_components import ERROR_COLOR, button
from modules.ui.UIState import UIState


class CtkCaptionWindow(ctk.CTkToplevel):
    def __init__(self, app, index: int, state: UIState):
        super().__init__(app)
        self.app = app
        self.controller = CaptionController(state, index)
        self.title(f"caption concept {index}")
        self.geometry("760x430")
        self.transient(app)
        self.grid_columnconfigure(1, weight=1)
        s = self.controller.settings
        self.model = self._entry(0, "model (hub id or folder)", s.model, browse=True)
        ctk.CTkLabel(self, text="prompt", anchor="w").grid(row=1, column=0, sticky="nw", padx=8, pady=4)
        self.prompt = ctk.CTkTextbox(self, height=70, wrap="word")
        self.prompt.grid(row=1, column=1, columnspan=2, sticky="ew", padx=8, pady=4)
        self.prompt.insert("1.0", s.prompt)
        self.frames = self._entry(2, "frames per video", str(s.frames))
        self.prefix = self._entry(3, "prefix (e.g. trigger word)", s.prefix)
        self.overwrite = ctk.CTkCheckBox(self, text="replace existing captions", command=self.refresh_plan)
        self.overwrite.grid(row=4, column=1, sticky="w", padx=8, pady=4)
        self.allow_download = ctk.CTkCheckBox(self, text="allow downloading the model")
        self.allow_download.grid(row=5, column=1, sticky="w", padx=8, pady=4)
        actions = ctk.CTkFrame(self, fg_color="transparent")
        actions.grid(row=6, column=0, columnspan=3, sticky="w", padx=8, pady=6)
        self.start_button = button(actions, "Start captioning", self.start, width=150)
        self.start_button.grid(row=0, column=0, padx=(0, 6))
        button(actions, "Stop", self.controller.stop, width=80).grid(row=0, column=1)
        self.bar = ctk.CTkProgressBar(self)
        self.bar.grid(row=7, column=0, columnspan=3, sticky="ew", padx=8, pady=4)
        self.bar.set(0)
        self.status = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=720)
        self.status.grid(row=8, column=0, columnspan=3, sticky="w", padx=8)
        self.error = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=720, text_color=ERROR_COLOR)
        self.error.grid(row=9, column=0, columnspan=3, sticky="w", padx=8)
        self._poll_job = None
        self.protocol("WM_DELETE_WINDOW", self.close)
        self.refresh_plan()

    def _entry(self, row: int, label: str, value: str, browse: bool = False) -> ctk.CTkEntry:
        ctk.CTkLabel(self, text=label, anchor="w").grid(row=row, column=0, sticky="w", padx=8, pady=4)
        entry = ctk.CTkEntry(self)
        entry.insert(0, value)
        entry.grid(row=row, column=1, sticky="ew", padx=8, pady=4)
        if browse:
            button(self, "…", lambda: self._browse(entry), width=30).grid(row=row, column=2, padx=(0, 8))
        return entry

    def _browse(self, entry: ctk.CTkEntry) -> None:
        from tkinter import filedialog
        chosen = filedialog.askdirectory(parent=self)
        if chosen:
            entry.delete(0, "end")
            entry.insert(0, chosen)

    def read_settings(self) -> str | None:
        """The widgets into the controller's settings; a message when a number does not parse."""
        s = self.controller.settings
        s.model = self.model.get().strip()
        s.prompt = self.prompt.get("1.0", "end").strip()
        s.prefix = self.prefix.get()
        s.overwrite = bool(self.overwrite.get())
        s.allow_download = bool(self.allow_download.get())
        try:
            s.frames = int(self.frames.get())
        except ValueError:
            return f"frames per video: {self.frames.get()!r} is not a whole number"
        return None

    def refresh_plan(self) -> None:
        self.read_settings()
        self.status.configure(text=self.controller.plan())

    def start(self) -> None:
        problem = self.read_settings()
        if self.app.controller.running:   # two models on one card: the run's memory plan would no longer hold
            problem = "training is running: caption before or after it (both would need the GPU's memory)"
        if problem or not self.controller.start():
            self.error.configure(text=problem or self.controller.progress.error)
            return
        self.error.configure(text="")
        self.start_button.configure(state="disabled")
        self._poll()

    def _poll(self) -> None:
        if not self.winfo_exists():
            return
        progress = self.controller.progress
        self.bar.set(progress.done / progress.total if progress.total else (0 if progress.running else 1))
        self.status.configure(text=progress.status)
        if progress.running:
            self._poll_job = self.after(100, self._poll)
            return
        self._poll_job = None
        self.start_button.configure(state="normal")
        skipped = "\n".join(progress.skipped[:10])
        self.error.configure(text="\n".join(t for t in (progress.error, skipped) if t))

    def close(self) -> None:
        self.controller.stop()
        if self._poll_job:
            self.after_cancel(self._poll_job)
        self.destroy()
