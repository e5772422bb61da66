"""The loss tab: training loss raw and smoothed, learning rate and validation loss of the current run and of the
workspace's earlier runs (modules/ui/LossHistory.py reads their TensorBoard events), over a step axis; the step range
is zoomed with the from / to fields or by dragging across the graph (right click: the whole run).

The events are read off the UI thread (modules/ui/LossFollower.py, only what was appended since the last reading);
the graph is drawn from the follower's snapshot, and only while this tab is shown."""
from __future__ import annotations

import math
import tkinter as tk
from pathlib import Path

import customtkinter as ctk

from modules.ui import LossHistory as history
from modules.ui.LossFollower import COLUMNS, LossFollower, Source
from modules.ui.ctk_components import EntryText, button
from modules.ui.plot_data import LOSS_SCALE, loss_axis, plot_area, stack_check_axis, y_of

COLORS = {"loss": "#335f7f", "smoothed": "#4aa3df", "lr": "#ffb74d", "validation": "#e57373",
          history.STACK_CHECK: "#81c784"}
CURRENT = "(this window's run)"
POLL_MS = 300


class CtkLossView:
    def __init__(self, frame, app):
        self.app = app
        bar = ctk.CTkFrame(frame, fg_color="transparent")
        bar.grid(row=0, column=0, sticky="w", padx=8, pady=4)
        self.run_menu = ctk.CTkOptionMenu(bar, values=[CURRENT], width=260, command=lambda _v: self.reload())
        self.run_menu.grid(row=0, column=0, padx=4)
        self.shown_curves = {}
        # the stack check (docs/distilled.md): at each accelerated preview, the distance from the full-step sample
        for column, name in enumerate(("loss", "smoothed", "lr", "validation", history.STACK_CHECK), 1):
            variable = tk.BooleanVar(value=True)
            ctk.CTkCheckBox(bar, text=name, variable=variable, width=90, command=self.draw,
                            text_color=COLORS[name]).grid(row=0, column=column, padx=2)
            self.shown_curves[name] = variable
        ctk.CTkLabel(bar, text="steps").grid(row=0, column=6, padx=(12, 2))
        entries = [ctk.CTkEntry(bar, width=70, placeholder_text=hint) for hint in ("from", "to")]
        for column, entry in enumerate(entries, 7):
            entry.grid(row=0, column=column, padx=2)
            entry.bind("<Return>", lambda _e: self.draw())
        self.first, self.last = (EntryText(entry) for entry in entries)
        button(bar, "whole run", self.reset_range, width=90).grid(row=0, column=9, padx=4)
        button(bar, "reload", self.reload, width=70).grid(row=0, column=10, padx=4)
        self.canvas = tk.Canvas(frame, width=1180, height=520, background="#1d1d1d", highlightthickness=0)
        self.canvas.grid(row=1, column=0, padx=8, pady=4, sticky="nw")
        self.canvas.bind("<ButtonPress-1>", self._drag_start)
        self.canvas.bind("<ButtonRelease-1>", self._drag_end)
        self.canvas.bind("<Button-3>", lambda _e: self.reset_range())
        self._frame = plot_area(1180, 520)   # left, top, right, bottom of the plot area
        # the graph takes the tab's space: an end-of-run panel under the bar makes it shorter, never hides its foot
        app.tabview.tab("loss").bind("<Configure>", lambda e: self.fit(e.width - 40, e.height - 96), add="+")
        self._span = (0, 1)
        self.follower = LossFollower()
        controller = app.controller   # not the view: the follower's thread must hold no Tk object
        self._own_losses = lambda: controller.run.losses
        self.canvas.bind("<Destroy>", lambda _e: self.follower.stop(), add="+")
        self.drawn_version = -1
        self.draw_count = 0
        self.refresh_runs()
        self.canvas.after(POLL_MS, self._poll)

    # ---- data ----------------------------------------------------------------------------------------------------

    @property
    def run(self) -> history.RunCurves | None:
        snapshot = self.follower.snapshot
        return snapshot.run if snapshot is not None else None

    def workspace(self) -> str:
        return self.app.config_state.get("workspace_dir") or "workspace"

    def refresh_runs(self) -> None:
        names = [CURRENT] + [folder.name for folder in reversed(history.run_folders(self.workspace()))]
        self.run_menu.configure(values=names)
        if self.run_menu.get() not in names:
            self.run_menu.set(CURRENT)
        self.reload()

    def _source(self) -> Source | None:
        root = Path(self.workspace()) / "tensorboard"
        choice = self.run_menu.get()
        if choice != CURRENT:
            return Source(root / choice)
        controller = self.app.controller
        name = getattr(controller.trainer, "run_name", None) or controller.last_run_name
        if name is None:
            return None
        # tensorboard off: the losses the worker reported
        return Source(root / name, self._own_losses, (controller.run.resumed_from or 0) + 1)

    def reload(self) -> None:
        """The chosen run read again now (in the follower's thread)."""
        source = self._source()
        if source is not None:
            self.follower.follow(source)
        self.drawn_version = -1

    def shown(self) -> bool:
        return self.app.tabview.get() == "loss"

    def _poll(self) -> None:
        """Follows the window's new run, and draws a new snapshot while the tab is shown."""
        source = self._source()
        if source is not None and source != self.follower.source:
            self.follower.follow(source)
        if self.follower.version != self.drawn_version and self.shown():
            self.draw()
        self.canvas.after(POLL_MS, self._poll)

    def reset_range(self) -> None:
        self.first.set("")
        self.last.set("")
        self.draw()

    def _range(self) -> tuple[int | None, int | None]:
        def number(text: str) -> int | None:
            return int(text) if text.strip().lstrip("-").isdigit() else None
        return number(self.first.get()), number(self.last.get())

    # ---- zoom by dragging ------------------------------------------------------------------------------------------

    def _step_at(self, x: float) -> int:
        left, _, right, _ = self._frame
        low, high = self._span
        return round(low + (high - low) * min(1.0, max(0.0, (x - left) / (right - left))))

    def _drag_start(self, event) -> None:
        self._drag_from = event.x

    def _drag_end(self, event) -> None:
        a, b = sorted((self._step_at(self._drag_from), self._step_at(event.x)))
        if b - a >= 2:
            self.first.set(str(a))
            self.last.set(str(b))
            self.draw()

    # ---- drawing ---------------------------------------------------------------------------------------------------

    def draw(self) -> None:
        canvas = self.canvas
        canvas.delete("all")
        self.drawn_version = self.follower.version
        self.draw_count += 1
        left, top, right, bottom = self._frame
        canvas.create_rectangle(left, top, right, bottom, outline="#666666")
        snapshot = self.follower.snapshot
        run = snapshot.run if snapshot is not None else None
        first, last = self._range()
        if first is None and last is None:   # the whole run: the follower's decimated lines
            curves = dict(snapshot.overview) if snapshot is not None else {}
        else:                                # zoomed: this range at the plot's resolution
            curves = {name: history.decimate(history.in_range(points, first, last), COLUMNS)
                      for name, points in (run.curves if run else {}).items()}
        curves = {name: points for name, points in curves.items() if points and self.shown_curves[name].get()}
        if not curves:
            canvas.create_text((left + right) / 2, (top + bottom) / 2, fill="#aaaaaa",
                               text=self.follower.error or
                               "no loss yet: start a run, or pick an earlier run of the workspace above")
            return
        steps = [s for points in curves.values() for s, _ in points]
        low_step, high_step = min(steps), max(steps)
        self._span = (low_step, max(high_step, low_step + 1))
        axis = loss_axis(curves)

        def x_of(step):
            return left + (right - left) * (step - self._span[0]) / (self._span[1] - self._span[0])

        for tick in history.nice_ticks(*self._span):
            x = x_of(tick)
            canvas.create_line(x, bottom, x, bottom + 4, fill="#888888")
            canvas.create_text(x, bottom + 6, text=f"{tick:g}", anchor="n", fill="#aaaaaa")
        canvas.create_text((left + right) / 2, bottom + 26, text="step", anchor="n", fill="#aaaaaa")
        if axis is not None:
            for tick in history.nice_ticks(*axis, 5):
                y = y_of(tick, axis, top, bottom)
                canvas.create_text(left - 4, y, text=f"{tick:.3g}", anchor="e", fill="#aaaaaa")
                canvas.create_line(left, y, right, y, fill="#2a2a2a")
            for name in LOSS_SCALE:
                points = [(s, v) for s, v in curves.get(name, []) if math.isfinite(v)]
                if points:
                    self._line(points, x_of, lambda v: y_of(v, axis, top, bottom), COLORS[name],
                               2 if name != "loss" else 1)
        if "lr" in curves:   # its own scale, labelled on the right
            values = [v for _, v in curves["lr"]]
            lr_low, lr_high = min(values), max(values)
            lr_span = (lr_high - lr_low) or abs(lr_high) or 1.0
            self._line(curves["lr"], x_of, lambda v: bottom - (bottom - top) * (v - lr_low) / lr_span,
                       COLORS["lr"], 1)
            canvas.create_text(right + 4, top, text=f"lr {lr_high:.3g}", anchor="nw", fill=COLORS["lr"])
            canvas.create_text(right + 4, bottom, text=f"{lr_low:.3g}", anchor="sw", fill=COLORS["lr"])
        if history.STACK_CHECK in curves:   # its own scale, from 0 at the plot's foot
            points = [(s, v) for s, v in curves[history.STACK_CHECK] if math.isfinite(v)]
            stack_axis = stack_check_axis(points)
            color = COLORS[history.STACK_CHECK]
            if points:
                self._line(points, x_of, lambda v: y_of(v, stack_axis, top, bottom), color, 2)
                for s, v in points:   # each preview a dot: the check exists only at preview steps
                    x, y = x_of(s), y_of(v, stack_axis, top, bottom)
                    canvas.create_oval(x - 3, y - 3, x + 3, y + 3, fill=color, outline="")
            # inside the plot's top right corner: the right margin holds the lr's labels
            canvas.create_text(right - 6, top + 4, text=f"stack check: 0 (foot) to {stack_axis[1]:.3g} (top)",
                               anchor="ne", fill=color)
        canvas.create_text(left + 6, top + 4, anchor="nw", fill="#cccccc",
                           text=f"{run.name}: steps {low_step}-{high_step}")

    def fit(self, width: int, height: int) -> None:
        """The canvas and its plot area sized to the tab's space (drawn again when the size changed)."""
        width, height = max(400, width), max(200, height)
        if (width, height) == (int(self.canvas.cget("width")), int(self.canvas.cget("height"))):
            return
        self.canvas.configure(width=width, height=height)
        self._frame = plot_area(width, height)
        if self.shown():
            self.draw()

    def _line(self, points, x_of, y_of, color: str, width: int) -> None:
        if len(points) == 1:
            x, y = x_of(points[0][0]), y_of(points[0][1])
            self.canvas.create_oval(x - 2, y - 2, x + 2, y + 2, fill=color, outline="")
            return
        self.canvas.create_line(*[c for s, v in points for c in (x_of(s), y_of(v))], fill=color, width=width)
