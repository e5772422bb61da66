"""The concepts tab: the data settings, one card per concept, and a concept window with all of a concept's
settings and its statistics (computed by the data loader's scan in a worker thread, shown through `after`)."""
from __future__ import annotations

import threading
from tkinter import filedialog

import customtkinter as ctk

from modules.ui.ConceptController import CONCEPTS, ConceptStatistics
from modules.util.config.config_io import ConfigError
from modules.ui.ctk_components import BoundField, button, draw_bars, render_section, thumbnail_image

CARD_FIELDS = ["enabled", "name", "path", "caption_source", "repeats", "fps", "extraction", "validation"]


class CtkConceptsView:
    def __init__(self, frame, app):
        self.app, self.state, self.controller = app, app.config_state, app.concepts
        row = render_section(frame, self.state, "data", skip=["dataloader_threads", "ti2v_image_probability"],
                             fields=app.fields, title="data")
        bar = ctk.CTkFrame(frame, fg_color="transparent")
        bar.grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=(10, 4))
        ctk.CTkLabel(bar, text="concepts", font=ctk.CTkFont(weight="bold")).grid(row=0, column=0, padx=(0, 10))
        button(bar, "Add concept", self.add, width=110).grid(row=0, column=1)
        self.cards = ctk.CTkFrame(frame, fg_color="transparent")
        self.cards.grid(row=row + 1, column=0, columnspan=3, sticky="nw", padx=4)
        self.windows: dict[int, CtkConceptWindow] = {}
        self.refresh()

    def add(self) -> None:
        path = filedialog.askdirectory(parent=self.app, title="a folder of clips and images")
        self.controller.add(path or "")
        self.refresh()

    def refresh(self) -> None:
        self.state.unbind_prefix(f"{CONCEPTS}.")
        for child in self.cards.winfo_children():
            child.destroy()
        for index, _concept in enumerate(self.controller.concepts()):
            card = ctk.CTkFrame(self.cards, border_width=1)
            card.grid(row=index // 2, column=index % 2, sticky="nw", padx=6, pady=6)
            header = ctk.CTkFrame(card, fg_color="transparent")
            header.grid(row=0, column=0, columnspan=3, sticky="ew", padx=4, pady=4)
            ctk.CTkLabel(header, text=self.controller.title(index), font=ctk.CTkFont(weight="bold")).grid(
                row=0, column=0, padx=4)
            button(header, "Open…", lambda i=index: self.open_window(i), width=70).grid(row=0, column=1, padx=4)
            button(header, "Remove", lambda i=index: self.remove(i), width=70, fg_color="#7f3030").grid(
                row=0, column=2, padx=4)
            for row, name in enumerate(CARD_FIELDS, start=1):
                path = f"{CONCEPTS}.{index}.{name}"
                self.app.fields[path] = BoundField(card, self.state, path, row, width=200, label_width=110)

    def remove(self, index: int) -> None:
        self.controller.remove(index)
        self.refresh()

    def open_window(self, index: int) -> "CtkConceptWindow":
        window = CtkConceptWindow(self, index)
        self.windows[index] = window
        return window


class CtkConceptWindow(ctk.CTkToplevel):
    def __init__(self, view: CtkConceptsView, index: int):
        super().__init__(view.app)
        self.view, self.index = view, index
        self.title(f"concept: {view.controller.title(index)}")
        self.geometry("980x760")
        self.transient(view.app)
        self.grid_columnconfigure(1, weight=1)
        self.grid_rowconfigure(0, weight=1)
        settings = ctk.CTkScrollableFrame(self, width=430)
        settings.grid(row=0, column=0, sticky="nsew", padx=6, pady=6)
        render_section(settings, view.state, f"{CONCEPTS}.{index}", width=180)
        stats = ctk.CTkScrollableFrame(self)
        stats.grid(row=0, column=1, sticky="nsew", padx=6, pady=6)
        stats.grid_columnconfigure(0, weight=1)
        actions = ctk.CTkFrame(stats, fg_color="transparent")
        actions.grid(row=0, column=0, sticky="w", pady=4)
        button(actions, "Compute statistics", self.compute, width=160).grid(row=0, column=0, padx=(0, 6))
        button(actions, "Browse items and captions…", self.browse, width=200).grid(row=0, column=1)
        button(actions, "Caption with a model…", self.caption, width=160).grid(row=1, column=0, sticky="w",
                                                                         pady=(4, 0))
        self.summary = ctk.CTkLabel(stats, text="", anchor="w", justify="left")
        self.summary.grid(row=1, column=0, sticky="w", pady=4)
        ctk.CTkLabel(stats, text="items per resolution bucket", anchor="w").grid(row=2, column=0, sticky="w")
        import tkinter as tk
        self.histogram = tk.Canvas(stats, width=440, height=130, background="#1d1d1d", highlightthickness=0)
        self.histogram.grid(row=3, column=0, sticky="w", pady=4)
        self.thumbs = ctk.CTkFrame(stats, fg_color="transparent")
        self.thumbs.grid(row=4, column=0, sticky="w", pady=4)
        self.skipped = ctk.CTkTextbox(stats, height=120, width=440)
        self.skipped.grid(row=5, column=0, sticky="ew", pady=4)
        self.result: ConceptStatistics | None = None
        self._images = []
        self.protocol("WM_DELETE_WINDOW", self.close)
        self.compute()

    def compute(self) -> None:
        self.summary.configure(text="scanning…")

        done: list[ConceptStatistics] = []
        try:
            config = self.view.controller.state.config()  # here, on the main loop: the user may be typing
        except ConfigError as error:
            self.show(ConceptStatistics(error="\n".join(error.problems)))
            return

        def work():  # no Tk call here: the result is picked up by `wait`, on the main loop
            try:
                result = self.view.controller.statistics(self.index, config=config)
            except Exception as error:  # noqa: BLE001  (shown in the window, never "scanning…" for ever)
                result = ConceptStatistics(error=f"{type(error).__name__}: {error}")
            done.append(result)

        def wait():
            if not self.winfo_exists():
                return
            if done:
                self.show(done[0])
            else:
                self.after(100, wait)

        threading.Thread(target=work, name="concept-statistics", daemon=True).start()
        self.after(100, wait)

    def show(self, result: ConceptStatistics) -> None:
        if not self.winfo_exists():
            return
        self.result = result
        frames = ", ".join(f"{f} frames: {n}" for f, n in sorted(result.frames_per_bucket.items())) or "-"
        text = f"{result.clips} clip items, {result.images} image items\nframes per bucket: {frames}\n" \
               f"skipped files: {len(result.skipped)}"
        self.summary.configure(text=(result.error + "\n\n" if result.error else "") + text)
        labels = list(result.resolution_buckets)
        draw_bars(self.histogram, [result.resolution_buckets[k] for k in labels], labels)
        for child in self.thumbs.winfo_children():
            child.destroy()
        self._images = []
        for column, (path, frame) in enumerate(result.thumbnails):
            picture = thumbnail_image(frame, 96)
            self._images.append(picture)
            ctk.CTkLabel(self.thumbs, image=picture, text="").grid(row=0, column=column, padx=3)
        self.skipped.delete("1.0", "end")
        self.skipped.insert("end", "\n".join(f"{path}: {reason}" for path, reason in result.skipped) or
                            "no file was skipped")

    def browse(self):
        from modules.ui.CtkDatasetWindow import CtkDatasetWindow
        self.dataset_window = CtkDatasetWindow(self.view.app, self.index)
        return self.dataset_window

    def caption(self):
        from modules.ui.CtkCaptionWindow import CtkCaptionWindow
        self.caption_window = CtkCaptionWindow(self.view.app, self.index, self.view.state)
        return self.caption_window

    def close(self) -> None:
        self.view.windows.pop(self.index, None)
        self.destroy()
        self.view.refresh()
