"""The gallery tab: every preview of the workspace's runs as a grid (modules/ui/SampleGallery.py): rows are samples,
columns are steps, newest first, each cell a playing thumbnail; hover shows step, prompt and seed; a click opens the
preview in the sampling tab's player. The grid scrolls both ways (Shift+wheel sideways); the prompts stay at the
left. The run being trained (here, or on a remote machine: its previews as they come home) is shown as soon as it
starts, and its new previews are added as they are made (its folder read in a thread, only the new cells decoded).
Thumbnails are decoded in a thread; one timer plays them all."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import customtkinter as ctk
from PIL import Image

from modules.ui import SampleGallery as gallery
from modules.ui.ctk_components import ToolTip, button
from modules.ui.CtkTwoWayScroll import CtkTwoWayScroll
from modules.ui.SamplingController import PreviewPlayer

THUMB = 96
HEADER_HEIGHT = 28   # the step labels' row; the row headers' corner has the same height, so the rows line up
ROW_LABEL_WIDTH = 190   # a prompt folder name cut to 28 characters fits
THUMB_FRAMES = 12
TICK_MS = 120
FOLLOW_MS = 500     # the followed run's new previews are looked for every SCAN_S, shown within FOLLOW_MS
SCAN_S = 2.0


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
        # the grid scrolls both ways: a long run's columns (newest step first) run off the window's width; the
        # prompts stay in view at the left, beside their rows
        self.scroll = CtkTwoWayScroll(frame, 900, 420, tuple(app.tabview.cget("fg_color")),
                                      row_headers=ROW_LABEL_WIDTH + 8)
        self.scroll.outer.grid(row=1, column=0, sticky="nw", padx=8)
        self.grid = self.scroll.inner
        # the visible part follows the tab's size (the tab's own frame, around its vertical scrolling one)
        app.tabview.tab("gallery").bind("<Configure>", lambda e: self.scroll.resize(e.width - 60, e.height - 70),
                                        add="+")
        self.runs: list[gallery.GalleryRun] = []
        self.cells: dict[tuple[str, int], dict] = {}
        self._labels: dict = {}            # ("step", n) / ("row", name) -> the grid's header labels
        self._drawn_run: str | None = None
        self._generation = 0
        self._tick_job = None
        self.following: str | None = None  # the run being trained: its previews appear as they are made
        self._scan: threading.Thread | None = None
        self._scanned: gallery.GalleryRun | None = None
        self._dirty = False
        self._last_scan = 0.0
        self.refresh()
        self.grid.after(FOLLOW_MS, self._poll)

    def workspace(self) -> str:
        return self.app.config_state.get("workspace_dir") or "workspace"

    def refresh(self) -> None:
        workspace = self.workspace()
        self.runs = gallery.gallery_runs(workspace)
        if self.following and self.following not in [run.name for run in self.runs]:
            self.runs.insert(0, gallery.GalleryRun(self.following, Path(workspace) / "samples" / self.following))
        self._set_menu()
        root = Path(workspace) / "compare"
        self.comparison_grids = {p.relative_to(root).as_posix(): p for p in gallery.comparison_grids(workspace)}
        self.grid_menu.configure(values=list(self.comparison_grids) or ["(no comparison grid)"])
        self.grid_menu.set(f"comparison grids: {len(self.comparison_grids)}")
        self.show_run()

    def _set_menu(self) -> None:
        names = [run.name for run in self.runs] or ["(no previews yet)"]
        self.run_menu.configure(values=names)
        if self.run_menu.get() not in names:
            self.run_menu.set(names[0])

    def follow(self, run_name: str) -> None:
        """The window's new run (its plan event): listed and shown at once, its previews added as they are made."""
        self.following = run_name
        if run_name not in [run.name for run in self.runs]:
            self.runs.insert(0, gallery.GalleryRun(run_name, Path(self.workspace()) / "samples" / run_name))
        self._set_menu()
        self.run_menu.set(run_name)
        self.show_run()

    def shown(self) -> bool:
        return self.app.tabview.get() == "gallery"

    def _poll(self) -> None:
        """While the followed run trains, its folder is read again in a worker (the settings files of new previews
        only); the grid gains the new cells when the tab is shown."""
        if not self.grid.winfo_exists():
            return
        scanned, self._scanned = self._scanned, None
        if scanned is not None:
            index = next((i for i, run in enumerate(self.runs) if run.name == scanned.name), None)
            if index is not None and (self.runs[index].cells.keys() != scanned.cells.keys()):
                self.runs[index] = scanned
                self._dirty = self._dirty or self.run_menu.get() == scanned.name
        if self._scan is not None and not self._scan.is_alive():
            self._scan = None
        if (self._scan is None and self.following and (self.app.controller.running or self.app.remote.running)
                and time.monotonic() - self._last_scan > SCAN_S):
            self._start_scan()
        if self._dirty and self.shown():
            self._dirty = False
            self.show_run()
        self.grid.after(FOLLOW_MS, self._poll)

    def _start_scan(self) -> None:
        run = next((r for r in self.runs if r.name == self.following), None)
        if run is None:
            return
        self._last_scan = time.monotonic()

        def scan():   # no Tk call in this thread
            if run.folder.is_dir():
                self._scanned = gallery.read_run(run.folder, known=run)

        self._scan = threading.Thread(target=scan, name="gallery-scan", daemon=True)
        self._scan.start()

    def show_run(self) -> None:
        """The chosen run's grid, newest step first. The same run drawn again keeps its cells (and their decoded
        thumbnails): only new previews are added and decoded."""
        run = next((r for r in self.runs if r.name == self.run_menu.get()), None)
        if run is None or run.name != self._drawn_run:
            for child in self.grid.winfo_children() + self.scroll.headers.winfo_children():
                child.destroy()
            self.cells, self._labels = {}, {}
            self._generation += 1
            self._drawn_run = run.name if run is not None else None
            self.scroll.canvas.yview_moveto(0)   # another run: from its first sample
        if run is None or not run.rows:
            if not self._labels:
                text = ("previews appear here: set a samples file on the sampling tab and train" if run is None else
                        f"no previews of {run.name} yet: they appear here as the run makes them")
                self._labels["empty"] = ctk.CTkLabel(self.grid, text=text, anchor="w")
                self._labels["empty"].grid(row=0, column=0, sticky="w")
            return
        if "empty" in self._labels:
            self._labels.pop("empty").destroy()
        self.info.configure(text=f"{len(run.rows)} sample(s) x {len(run.steps)} step(s), newest first")

        def label(key, master=None, **options):
            if key not in self._labels:
                self._labels[key] = ctk.CTkLabel(master or self.grid, **options)
            return self._labels[key]

        headers = self.scroll.headers   # the prompts' column: scrolls up and down with the grid, never sideways
        label(("corner",), headers, text="sample \\ step", anchor="w", height=HEADER_HEIGHT).grid(
            row=0, column=0, sticky="w", padx=4)
        steps = sorted(run.steps, reverse=True)   # newest first: the latest previews in view without scrolling
        for column, step in enumerate(steps, 1):
            label(("step", step), text=str(step), height=HEADER_HEIGHT).grid(row=0, column=column, padx=2)
        new = []
        for row_index, row in enumerate(run.rows, 1):
            label(("row", row), headers, text=row[:28], anchor="w", width=ROW_LABEL_WIDTH, height=THUMB).grid(
                row=row_index, column=0, sticky="w", padx=4, pady=2)
            for column, step in enumerate(steps, 1):
                cell = run.cells.get((row, step))
                if cell is None:
                    continue
                entry = self.cells.get((row, step))
                if entry is None:
                    widget = ctk.CTkLabel(self.grid, text="…", width=THUMB, height=THUMB, fg_color="#111111")
                    widget.bind("<Button-1>", lambda _e, c=cell: self.open(c))
                    ToolTip(widget, cell.tooltip, delay_ms=300)
                    entry = self.cells[(row, step)] = {"cell": cell, "label": widget, "images": [], "index": 0}
                    new.append(entry)
                entry["label"].grid(row=row_index, column=column, padx=2, pady=2)
        self.scroll.canvas.xview_moveto(0)
        if new:
            self._decode(self._generation, new)

    def _decode(self, generation: int, entries: list[dict]) -> None:
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
