"""customtkinter building blocks shared by the views: tooltips, one bound widget per config field, the generic
section renderer, and Canvas plots (line and bars; no plotting library)."""
from __future__ import annotations

import threading
import tkinter as tk
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import customtkinter as ctk
import numpy as np
from PIL import Image

from modules.ui.config_fields import FieldSpec, section_fields
from modules.ui.UIState import UIState

ERROR_COLOR = "#d9534f"
UNSET = "(not set)"  # how a choice menu shows "" / None (an override left to the default)
LABEL_WIDTH = 190


class ToolTip:
    """A small window with `text` under the pointer while it rests on `widget`."""

    def __init__(self, widget, text: str, delay_ms: int = 500):
        self.widget, self.text, self.delay_ms = widget, text, delay_ms
        self._job = None
        self._window: tk.Toplevel | None = None
        widget.bind("<Enter>", self._schedule, add="+")
        widget.bind("<Leave>", self._hide, add="+")
        widget.bind("<ButtonPress>", self._hide, add="+")

    def _schedule(self, _event=None):
        self._hide()
        self._job = self.widget.after(self.delay_ms, self._show)

    def _show(self):
        if not self.text or not self.widget.winfo_exists():
            return
        x, y = self.widget.winfo_rootx() + 12, self.widget.winfo_rooty() + self.widget.winfo_height() + 4
        self._window = window = tk.Toplevel(self.widget)
        window.wm_overrideredirect(True)
        window.wm_geometry(f"+{x}+{y}")
        tk.Label(window, text=self.text, justify="left", background="#ffffe0", foreground="#000000",
                 relief="solid", borderwidth=1, wraplength=420, padx=6, pady=3).pack()

    def _hide(self, _event=None):
        if self._job is not None:
            self.widget.after_cancel(self._job)
            self._job = None
        if self._window is not None:
            self._window.destroy()
            self._window = None


FOLDER_FIELDS = {"workspace_dir", "cache_dir", "base_model_name", "data_root"}
FILE_FIELDS = {"samples_file", "prompt_path", "init_from", "dataset_config", "image"}


def path_kind(path: str) -> str | None:
    """Which browse dialog a text field gets: "folder", "file", "save" (a destination), or None."""
    name = path.rsplit(".", 1)[-1]
    if name in FOLDER_FIELDS or (name == "path" and path.startswith("data.concepts.")):
        return "folder"
    if name in FILE_FIELDS or (name == "path" and path.startswith("model.")) or \
            (name in ("file", "file_2") and path.startswith("sampling.accelerator.")):
        return "file"
    return "save" if name == "destination" else None


def label_text(spec: FieldSpec) -> str:
    return spec.name.replace("_", " ")


class BoundField:
    """One config field: its label, its widget (by the field's kind) and its error line, bound through UIState."""

    def __init__(self, master, state: UIState, path: str, row: int, label: str | None = None, width: int = 260,
                 column: int = 0, label_width: int = LABEL_WIDTH, error_width: int = 420,
                 reserve_error: bool = False):
        self.state, self.path = state, path
        self.spec = spec = state.spec(path)
        self.label = ctk.CTkLabel(master, text=label or label_text(spec), anchor="w", width=label_width)
        self.label.grid(row=row, column=column, sticky="w", padx=(8, 4), pady=2)
        self.variable = tk.StringVar(master)
        if spec.kind == "bool":
            self.widget = ctk.CTkSwitch(master, text="", variable=self.variable, onvalue="true", offvalue="false",
                                        command=self._commit)
        elif spec.kind == "choice":
            values = [UNSET if value == "" else value for value in spec.choices]
            values += [UNSET] if spec.optional and UNSET not in values else []
            self.widget = ctk.CTkOptionMenu(master, values=values, variable=self.variable, width=width,
                                            command=lambda _value: self._commit())
        elif spec.choices:
            self.widget = ctk.CTkComboBox(master, values=list(spec.choices), variable=self.variable, width=width,
                                          command=lambda _value: self._commit())
            self.widget.bind("<KeyRelease>", lambda _e: self._commit(), add="+")
        else:
            browse = path_kind(path) if spec.kind == "str" else None
            holder = master
            if browse:   # the entry and its "…" button share the widget's grid cell: the columns stay as they are
                holder = ctk.CTkFrame(master, fg_color="transparent")
                holder.grid(row=row, column=column + 1, sticky="w", padx=4, pady=2)
                width -= 34
            self.widget = ctk.CTkEntry(holder, textvariable=self.variable, width=width)
            self.widget.bind("<KeyRelease>", lambda _e: self._commit(), add="+")
            if browse:
                self.widget.grid(row=0, column=0)
                self.browse_button = ctk.CTkButton(holder, text="…", width=30, command=lambda: self.browse(browse))
                self.browse_button.grid(row=0, column=1, padx=(4, 0))
        if self.widget.master is master:
            self.widget.grid(row=row, column=column + 1, sticky="w", padx=4, pady=2)
        self._cells = [self.label, self.widget if self.widget.master is master else holder]
        # the error column keeps its width whether a message shows or not, so no field moves when one appears
        self.error = ctk.CTkLabel(master, text="", text_color=ERROR_COLOR, anchor="w", justify="left",
                                  wraplength=error_width, width=error_width if reserve_error else 0)
        self.error.grid(row=row, column=column + 2, sticky="w", padx=4)
        tip = spec.description or ""
        if tip:
            ToolTip(self.label, tip)
            ToolTip(self.widget, tip)
        state.bind(path, self.show, self.show_error)

    def set_visible(self, visible: bool) -> None:
        """Shows or hides the field's row (its grid place is kept for when it shows again)."""
        for widget in self._cells + [self.error]:
            widget.grid() if visible else widget.grid_remove()

    def show(self, text: str) -> None:
        if self.spec.kind == "choice" and text == "":
            text = UNSET
        if self.variable.get() != text:
            self.variable.set(text)

    def show_error(self, message: str | None) -> None:
        # the message starts with the dotted field, as the CLI prints it
        self.error.configure(text=message or "")
        if isinstance(self.widget, (ctk.CTkEntry, ctk.CTkComboBox)):
            self.widget.configure(border_color=ERROR_COLOR if message else ctk.ThemeManager.theme["CTkEntry"][
                "border_color"])

    def _commit(self) -> None:
        text = self.variable.get()
        if self.spec.kind == "choice" and text == UNSET:
            text = ""
        self.state.set_text(self.path, text, origin=self.show)

    def browse(self, kind: str) -> None:
        chosen = ask_path(self.widget, kind, self.variable.get())
        if chosen:
            self.set_text(chosen)

    def set_text(self, text: str) -> None:
        """As if the user typed `text` (tests drive widgets through this as well as through xdotool)."""
        self.variable.set(text)
        self._commit()


def render_section(master, state: UIState, section_path: str, *, only: Iterable[str] | None = None,
                   skip: Iterable[str] = (), start_row: int = 0, fields: dict[str, BoundField] | None = None,
                   title: str | None = None, width: int = 260, error_width: int = 420) -> int:
    """One row per simple field of `section_path` (declaration order), or of `only` in that order; a new simple
    config field shows up here with no view code. Returns the next free row. `fields` collects the widgets by
    path."""
    row = start_row
    if title:
        ctk.CTkLabel(master, text=title, font=ctk.CTkFont(weight="bold")).grid(row=row, column=0, columnspan=3,
                                                                               sticky="w", padx=8, pady=(10, 2))
        row += 1
    specs = section_fields(section_path)
    if only is not None:
        by_name = {spec.name: spec for spec in specs}
        specs = [by_name[name] for name in only if name in by_name]
    skip = set(skip)
    for spec in specs:
        if not spec.simple or spec.name in skip:
            continue
        field = BoundField(master, state, spec.path, row, width=width, error_width=error_width, reserve_error=True)
        if fields is not None:
            fields[spec.path] = field
        row += 1
    return row


def scrollable_tab(tabview: ctk.CTkTabview, name: str) -> ctk.CTkScrollableFrame:
    tab = tabview.add(name)
    tab.grid_columnconfigure(0, weight=1)
    tab.grid_rowconfigure(0, weight=1)
    # the tabview's colour pair, not "transparent": the widgets inside take their background from this frame, and
    # from a transparent one they got the current mode's colour only (dark labels on dark after a switch to light)
    frame = ctk.CTkScrollableFrame(tab, fg_color=tabview.cget("fg_color"))
    frame.grid(row=0, column=0, sticky="nsew")
    frame.grid_columnconfigure(2, weight=1)
    return frame


class EntryText:
    """An entry's text with a StringVar's get() / set(). CTkEntry shows its placeholder (the hint of an empty field)
    only when it has no textvariable: with one, every hint of a form was invisible."""

    def __init__(self, entry: ctk.CTkEntry):
        self.entry = entry

    def get(self) -> str:
        return self.entry.get()   # "" while the hint shows

    def set(self, text: str) -> None:
        self.entry.delete(0, "end")   # empty and not focused: the hint shows again
        if text:
            self.entry.insert(0, text)


def ask_path(parent, kind: str, current: str = "") -> str:
    """A file ("file"), folder ("folder") or new file ("save") chosen in the system dialog, starting where
    `current` points; "" when cancelled."""
    from tkinter import filedialog
    current = current.strip()
    start = current if current and Path(current).is_dir() else str(Path(current).parent) if current else "."
    if kind == "folder":
        return filedialog.askdirectory(parent=parent, initialdir=start) or ""
    if kind == "save":
        return filedialog.asksaveasfilename(parent=parent, initialdir=start) or ""
    return filedialog.askopenfilename(parent=parent, initialdir=start) or ""


def in_worker(widget, work: Callable[[], object], done: Callable[[object], None], name: str,
              interval_ms: int = 100) -> None:
    """Runs `work()` in a daemon thread (it makes no Tk call) and then `done(result)` on the main loop, `result`
    being what it returned or the Exception it raised; nothing when `widget` was destroyed meanwhile."""
    result: list = []

    def run():
        try:
            result.append(work())
        except Exception as error:  # noqa: BLE001  handed to done(), which shows it
            result.append(error)

    def wait():
        if not widget.winfo_exists():
            return
        if not result:
            widget.after(interval_ms, wait)
            return
        done(result[0])

    threading.Thread(target=run, name=name, daemon=True).start()
    widget.after(interval_ms, wait)


def button(master, text: str, command: Callable[[], None], width: int = 120, **kwargs) -> ctk.CTkButton:
    return ctk.CTkButton(master, text=text, command=command, width=width, **kwargs)


# --- plots on a Canvas -----------------------------------------------------------------------------------------

def _plot_frame(canvas: tk.Canvas, margin: int = 28) -> tuple[int, int, int, int]:
    canvas.delete("all")
    width = int(canvas.winfo_width()) if canvas.winfo_width() > 1 else int(canvas["width"])
    height = int(canvas.winfo_height()) if canvas.winfo_height() > 1 else int(canvas["height"])
    left, top, right, bottom = margin, 8, width - 8, height - 18
    canvas.create_rectangle(left, top, right, bottom, outline="#666666")
    return left, top, right, bottom


def draw_line_plot(canvas: tk.Canvas, values: Sequence[float], color: str = "#4aa3df", smooth: float = 0.9,
                   label: str = "") -> None:
    """The raw values faintly and an exponential moving average on top; y from min to max of the values."""
    left, top, right, bottom = _plot_frame(canvas)
    if label:
        canvas.create_text(left + 4, top + 2, text=label, anchor="nw", fill="#aaaaaa", font=("TkDefaultFont", 8))
    if len(values) < 2:
        return
    low, high = min(values), max(values)
    span = (high - low) or 1.0

    def point(i: int, v: float) -> tuple[float, float]:
        return (left + (right - left) * i / (len(values) - 1), bottom - (bottom - top) * (v - low) / span)

    canvas.create_line(*[c for i, v in enumerate(values) for c in point(i, v)], fill="#335f7f")
    averaged, ema = [], values[0]
    for v in values:
        ema = smooth * ema + (1 - smooth) * v
        averaged.append(ema)
    canvas.create_line(*[c for i, v in enumerate(averaged) for c in point(i, v)], fill=color, width=2)
    canvas.create_text(2, top, text=f"{high:.3g}", anchor="nw", fill="#aaaaaa", font=("TkDefaultFont", 7))
    canvas.create_text(2, bottom, text=f"{low:.3g}", anchor="sw", fill="#aaaaaa", font=("TkDefaultFont", 7))


def draw_bars(canvas: tk.Canvas, values: Sequence[float], labels: Sequence[str] = (), color: str = "#4aa3df",
              x_range: tuple[str, str] | None = None) -> None:
    """A histogram: one bar per value (scaled to the largest), labels under the bars or the range's two ends."""
    left, top, right, bottom = _plot_frame(canvas, margin=8)
    if not values:
        return
    highest = max(values) or 1.0
    width = (right - left) / len(values)
    for i, value in enumerate(values):
        x0 = left + i * width
        canvas.create_rectangle(x0 + 1, bottom - (bottom - top) * value / highest, x0 + width - 1, bottom,
                                fill=color, outline="")
        if labels and len(labels) == len(values):
            canvas.create_text(x0 + width / 2, bottom + 2, text=labels[i], anchor="n", fill="#aaaaaa",
                               font=("TkDefaultFont", 7))
    if x_range:
        canvas.create_text(left, bottom + 2, text=x_range[0], anchor="nw", fill="#aaaaaa", font=("TkDefaultFont", 7))
        canvas.create_text(right, bottom + 2, text=x_range[1], anchor="ne", fill="#aaaaaa",
                           font=("TkDefaultFont", 7))


def thumbnail_image(frame: np.ndarray, longest: int) -> ctk.CTkImage:
    """A uint8 (H, W, 3) frame as a CTkImage whose longer side is `longest` pixels (the aspect ratio kept)."""
    image = Image.fromarray(frame)
    scale = longest / max(image.size)
    size = (max(1, round(image.size[0] * scale)), max(1, round(image.size[1] * scale)))
    return ctk.CTkImage(light_image=image, dark_image=image, size=size)
