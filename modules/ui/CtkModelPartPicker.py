"""Model tab: a file / folder picker per part and a line saying what the chosen path holds (modules/ui/model_parts.py
reads it); the path itself is the `model.<part>.path` field rendered above it."""
import threading
from tkinter import filedialog

import customtkinter as ctk

from modules.ui.ctk_components import button
from modules.ui.model_parts import describe_for, field_of
from modules.ui.UIState import UIState

POLL_MS = 50
WEIGHT_FILES = [("model weights", "*.safetensors *.pth *.pt *.ckpt *.json"), ("all files", "*")]


class CtkModelPartPicker:
    def __init__(self, master, state: UIState, part: str, row: int):
        self.state, self.part = state, part
        frame = ctk.CTkFrame(master, fg_color="transparent")
        frame.grid(row=row, column=1, columnspan=2, sticky="w", padx=4, pady=(0, 4))
        button(frame, "File…", self._pick_file, width=70).grid(row=0, column=0, padx=(0, 4))
        button(frame, "Folder…", self._pick_folder, width=70).grid(row=0, column=1, padx=(0, 8))
        self.label = ctk.CTkLabel(frame, text="", anchor="w", justify="left", wraplength=560)
        self.label.grid(row=0, column=2, sticky="w")
        self._generation, self._answers = 0, {}
        self.refresh()

    def _set(self, path: str) -> None:
        if path:
            self.state.set_text(field_of(self.part), path)
            self.refresh()

    def _pick_file(self) -> None:
        self._set(filedialog.askopenfilename(title=f"{self.part} file", filetypes=WEIGHT_FILES))

    @property
    def field(self) -> str:
        return field_of(self.part)

    def _pick_folder(self) -> None:
        self._set(filedialog.askdirectory(title=f"{self.part} folder"))

    def refresh(self) -> None:
        """Describes the path in a worker thread (headers of large files, a folder search) and shows the latest
        answer when it arrives: typing a path never stalls the window."""
        self._generation += 1
        generation = self._generation
        path = self.state.get(field_of(self.part)) or ""   # read here: the state belongs to the main thread
        self.label.configure(text="…")

        def work() -> None:
            self._answers[generation] = describe_for(self.part, path)

        threading.Thread(target=work, daemon=True, name=f"describe-{self.part}").start()
        self.label.after(POLL_MS, self._show_answer, generation)

    def _show_answer(self, generation: int) -> None:
        if generation != self._generation:
            return   # the path changed since: its own poll shows the newer answer
        if generation in self._answers:
            self.label.configure(text=self._answers.pop(generation))
            self._answers.clear()
        else:
            self.label.after(POLL_MS, self._show_answer, generation)
