"""A view that scrolls both ways, with an optional column of row headers that scrolls up and down with it but stays
in place sideways (the gallery's prompt labels stay beside their rows while the steps scroll). The mouse wheel
scrolls it (Shift+wheel sideways: modules/ui/scrolling.py)."""
from __future__ import annotations

import sys
import tkinter as tk

import customtkinter as ctk

from modules.ui.scrolling import wheel_scroll


class CtkTwoWayScroll:
    """`inner` holds the content (CTkScrollableFrame scrolls one way only), `headers` (with `row_headers`) the row
    labels, which must be gridded with the same row heights as `inner`'s rows; `resize` fits the visible part to
    the space the window gives it."""

    def __init__(self, parent, width: int, height: int, colors: tuple[str, str], row_headers: int = 0):
        self.outer = ctk.CTkFrame(parent, fg_color="transparent")
        self.colors = colors   # (light, dark): the canvases are plain Tk and follow the appearance through this
        self.canvas = tk.Canvas(self.outer, width=width, height=height, highlightthickness=0)
        self.x_bar = ctk.CTkScrollbar(self.outer, orientation="horizontal", command=self.canvas.xview)
        self.y_bar = ctk.CTkScrollbar(self.outer, orientation="vertical", command=self.canvas.yview)
        self.canvas.configure(xscrollcommand=self.x_bar.set, yscrollcommand=self._y_moved)
        self.header_canvas = tk.Canvas(self.outer, width=row_headers, height=height, highlightthickness=0)
        if row_headers:
            self.header_canvas.grid(row=0, column=0, sticky="nw")
        self.canvas.grid(row=0, column=1, sticky="nw")
        self.y_bar.grid(row=0, column=2, sticky="ns")
        self.x_bar.grid(row=1, column=1, sticky="ew")
        self.inner = ctk.CTkFrame(self.canvas, fg_color=colors, corner_radius=0)
        self.canvas.create_window(0, 0, window=self.inner, anchor="nw")
        self.headers = ctk.CTkFrame(self.header_canvas, fg_color=colors, corner_radius=0)
        self.header_canvas.create_window(0, 0, window=self.headers, anchor="nw")
        self.inner.bind("<Configure>", lambda _e: self._fit_regions())
        self.headers.bind("<Configure>", lambda _e: self._fit_regions())
        self._follow_appearance(ctk.get_appearance_mode())
        ctk.AppearanceModeTracker.add(self._follow_appearance, self.canvas)
        self.canvas.bind("<Destroy>", lambda _e: ctk.AppearanceModeTracker.remove(self._follow_appearance),
                         add="+")
        # the wheel over any widget inside: bound for all widgets (as CTkScrollableFrame does), acted on for ours
        for sequence in ("<Button-4>", "<Button-5>", "<MouseWheel>",
                         "<Shift-MouseWheel>"):
            self.canvas.bind_all(sequence, self._wheel, add="+")

    def _fit_regions(self) -> None:
        """Both canvases scroll over the content's height, so one fraction shows the same rows in each."""
        height = max(self.inner.winfo_reqheight(), self.headers.winfo_reqheight())
        self.canvas.configure(scrollregion=(0, 0, self.inner.winfo_reqwidth(), height))
        self.header_canvas.configure(scrollregion=(0, 0, self.headers.winfo_reqwidth(), height))

    def _y_moved(self, first, last) -> None:
        """The grid moved up or down (scrollbar, wheel, code): the row headers follow."""
        self.y_bar.set(first, last)
        self.header_canvas.yview_moveto(first)

    def _wheel(self, event) -> None:
        if not self.canvas.winfo_exists() or not str(event.widget).startswith(str(self.outer) + "."):
            return
        motion = wheel_scroll(getattr(event, "num", 0) or 0, getattr(event, "delta", 0) or 0, event.state,
                              sys.platform)
        if motion is not None:
            axis, units = motion
            (self.canvas.xview_scroll if axis == "x" else self.canvas.yview_scroll)(units, "units")

    def _follow_appearance(self, mode: str) -> None:
        colour = self.colors[0 if mode.lower() == "light" else 1]
        self.canvas.configure(background=colour)
        self.header_canvas.configure(background=colour)

    def resize(self, width: int, height: int) -> None:
        headers = int(self.header_canvas.cget("width")) if self.header_canvas.winfo_manager() else 0
        self.canvas.configure(width=max(200, width - headers), height=max(120, height))
        self.header_canvas.configure(height=max(120, height))
