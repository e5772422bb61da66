"""The gallery tab: every preview of the workspace's runs as a grid (modules/ui/SampleGallery.py): rows are samples,
columns are steps, each cell a playing thumbnail; hover shows step, prompt and seed; a click opens the preview in
the sampling tab's player. Thumbnails are decoded in a thread; one timer plays them all."""
from __future__ import annotations

import threading
from pathlib import Path

import customtkinter as ctk
from PIL import Image

from modules.ui import SampleGallery as gallery
from modules.ui.ctk_components import ToolTip, button
from modules.ui.SamplingController import PreviewPlayer

THUMB = 96
THUMB_FRAMES = 12
TICK_MS = 120


def thumbnail_frames(path) -> list[Image.Image]:
    """Up to THUMB_FRAMES frames spread over the clip, THUMB pixels on the longer side."""
    frames, _fps = PreviewPlayer.read(path)
    picks = sorted({round(i * (len(frames) - 1) / max(1, THUMB_FRAMES - 1)) for i in range(THUMB_FRAMES)})
    images = []
    for index in picks:
        image = Image.fromarray(frames[index])
        scale = THUMB / max(image.size)
        images.append(image.resize((max(1, round(image.size[0] * scale)), max(1, round(image.size[1] * scale))),
                                   Image.Resampling.NEAREST))
    return images


class CtkGalleryView:
    def __init__(self, frame, app):
        self.app = app
        bar = ctk.CTkFrame(frame, fg_color="transparent")
        bar.grid(row=0, column=0, sticky="w", padx=8, pady=4)
        self.run_menu = ctk.CTkOptionMenu(bar, values=["(no previews yet)"], width=260,
                                          command=lambda _v: self.show_run())
        self.run_menu.grid(row=0, column=0, padx=4)
        button(bar, "reload", self.refresh, width=80).grid(row=0, column=1, padx=4)
        self.info = ctk.CTkLabel(bar, text="", anchor="w")
        self.info.grid(row=0, column=2, padx=8)
        # the compare tool's grids (checkpoint x strength): one opens in the sampling tab's player
        self.grid_menu = ctk.CTkOptionMenu(bar, values=["(no comparison grid)"], width=300,
                                           command=lambda _v: self.open_grid())
        self.grid_menu.grid(row=0, column=3, padx=4)
        self.comparison_grids: dict = {}   # menu entry (path under compare/) -> grid video
        self.grid = ctk.CTkFrame(frame, fg_color="transparent")
        self.grid.grid(row=1, column=0, sticky="nw", padx=8)
        self.runs: list[gallery.GalleryRun] = []
        self.cells: dict[tuple[str, int], dict] = {}
        self._generation = 0
        self._tick_job = None
        self.refresh()

    def refresh(self) -> None:
        self.runs = gallery.gallery_runs(self.app.config_state.get("workspace_dir") or "workspace")
        names = [run.name for run in self.runs] or ["(no previews yet)"]
        self.run_menu.configure(values=names)
        if self.run_menu.get() not in names:
            self.run_menu.set(names[0])
        workspace = self.app.config_state.get("workspace_dir") or "workspace"
        root = Path(workspace) / "compare"
        self.comparison_grids = {p.relative_to(root).as_posix(): p for p in gallery.comparison_grids(workspace)}
        self.grid_menu.configure(values=list(self.comparison_grids) or ["(no comparison grid)"])
        self.grid_menu.set(f"comparison grids: {len(self.comparison_grids)}")
        self.show_run()

    def show_run(self) -> None:
        for child in self.grid.winfo_children():
            child.destroy()
        self.cells = {}
        self._generation += 1
        run = next((r for r in self.runs if r.name == self.run_menu.get()), None)
        if run is None:
            ctk.CTkLabel(self.grid, text="previews appear here: set a samples file on the sampling tab and train",
                         anchor="w").grid(row=0, column=0, sticky="w")
            return
        ctk.CTkLabel(self.grid, text="sample \\ step", anchor="w").grid(row=0, column=0, sticky="w", padx=4)
        for column, step in enumerate(run.steps, 1):
            ctk.CTkLabel(self.grid, text=str(step)).grid(row=0, column=column, padx=2)
        for row_index, row in enumerate(run.rows, 1):
            ctk.CTkLabel(self.grid, text=row[:28], anchor="w", width=160).grid(row=row_index, column=0, sticky="w",
                                                                              padx=4)
            for column, step in enumerate(run.steps, 1):
                cell = run.cells.get((row, step))
                if cell is None:
                    continue
                label = ctk.CTkLabel(self.grid, text="…", width=THUMB, height=THUMB, fg_color="#111111")
                label.grid(row=row_index, column=column, padx=2, pady=2)
                label.bind("<Button-1>", lambda _e, c=cell: self.open(c))
                ToolTip(label, cell.tooltip, delay_ms=300)
                self.cells[(row, step)] = {"cell": cell, "label": label, "images": [], "index": 0}
        self._decode(self._generation)

    def _decode(self, generation: int) -> None:
        entries = list(self.cells.values())
        results: dict[int, list] = {}

        def work():  # no Tk call in this thread
            for number, entry in enumerate(entries):
                if generation != self._generation:
                    return
                try:
                    results[number] = thumbnail_frames(entry["cell"].path)
                except Exception as error:  # a half-written preview must not break the tab  # noqa: BLE001
                    results[number] = error

        def collect():
            if generation != self._generation:
                return
            for number in list(results):
                images = results.pop(number)
                entry = entries[number]
                if isinstance(images, Exception):
                    entry["label"].configure(text="cannot\nplay")
                    continue
                entry["images"] = [ctk.CTkImage(light_image=i, dark_image=i, size=i.size) for i in images]
            if self._tick_job is None:
                self._tick_job = self.grid.after(TICK_MS, self._tick)
            if any(not e["images"] for e in entries) and thread.is_alive():
                self.grid.after(100, collect)
            elif results:
                self.grid.after(10, collect)

        thread = threading.Thread(target=work, name="gallery-decode", daemon=True)
        thread.start()
        self.grid.after(50, collect)

    def _tick(self) -> None:
        self._tick_job = None
        if not self.grid.winfo_exists():
            return
        for entry in self.cells.values():
            if entry["images"]:
                entry["index"] = (entry["index"] + 1) % len(entry["images"])
                entry["label"].configure(image=entry["images"][entry["index"]], text="")
        self._tick_job = self.grid.after(TICK_MS, self._tick)

    @property
    def thumbnails_shown(self) -> int:
        return sum(1 for entry in self.cells.values() if entry["images"])

    def open_grid(self) -> None:
        path = self.comparison_grids.get(self.grid_menu.get())
        if path is not None:
            self.app.tabview.set("sampling")
            self.app.sampling_view.show_video(path)

    def open(self, cell: gallery.GalleryCell) -> None:
        self.app.tabview.set("sampling")
        self.app.sampling_view.show_video(cell.path)
