"""The elements tab (E2V): the e2v overrides, the first dataset's settings, its elements table and processors,
import / export of the user's JSON forms, and a live drawing of the mini-video and of the mask over latent frames
(from ElementsController.drawing: the data pipeline's own functions)."""
from __future__ import annotations

import tkinter as tk
from tkinter import filedialog

import customtkinter as ctk

from modules.ui.ctk_components import ERROR_COLOR, BoundField, button, render_section
from modules.ui.ElementsController import DATASET
from modules.util.config.config_io import ConfigError

SLOT_COLOURS = ("#e06c75", "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2", "#d19a66", "#abb2bf")
PREPROCESS = ("resize", "center_crop", "pad_white", "letterbox")
CELL = 22


class CtkElementsView:
    def __init__(self, frame, app):
        self.app, self.state, self.controller = app, app.config_state, app.elements
        self.frame = frame
        overrides = ctk.CTkFrame(frame, fg_color="transparent")
        overrides.grid(row=0, column=0, columnspan=3, sticky="w")
        row = render_section(overrides, self.state, "e2v", fields=app.fields, title="Elements-to-Video")
        bar = ctk.CTkFrame(frame, fg_color="transparent")
        bar.grid(row=1, column=0, columnspan=3, sticky="w", padx=8, pady=6)
        button(bar, "Import JSON…", self.ask_import).grid(row=0, column=0, padx=3)
        button(bar, "Export JSON…", self.ask_export).grid(row=0, column=1, padx=3)
        button(bar, "New dataset", self.new_dataset).grid(row=0, column=2, padx=3)
        button(bar, "Add element", self.add_element).grid(row=0, column=3, padx=3)
        self.problem_label = ctk.CTkLabel(frame, text="", text_color=ERROR_COLOR, anchor="w", justify="left",
                                          wraplength=1100)
        self.problem_label.grid(row=2, column=0, columnspan=3, sticky="w", padx=8)
        drawing = ctk.CTkFrame(frame)
        drawing.grid(row=3, column=0, columnspan=3, sticky="nw", padx=8, pady=8)
        controls = ctk.CTkFrame(drawing, fg_color="transparent")
        controls.grid(row=0, column=0, sticky="w", padx=4, pady=4)
        ctk.CTkLabel(controls, text="drawing for").grid(row=0, column=0, padx=4)
        self.frames_menu = ctk.CTkOptionMenu(controls, values=["17"], width=80, command=lambda _v: self.draw())
        self.frames_menu.grid(row=0, column=1, padx=4)
        ctk.CTkLabel(controls, text="frames").grid(row=0, column=2, padx=4)
        button(controls, "Draw random again", self.redraw_random, width=150).grid(row=0, column=3, padx=8)
        self.present_frame = ctk.CTkFrame(controls, fg_color="transparent")
        self.present_frame.grid(row=0, column=4, padx=8)
        self.present_vars: list[tk.BooleanVar] = []
        self.canvas = tk.Canvas(drawing, width=1100, height=170, background="#1d1d1d", highlightthickness=0)
        self.canvas.grid(row=1, column=0, padx=4, pady=4)
        self.dataset_frame = ctk.CTkFrame(frame, fg_color="transparent")
        self.dataset_frame.grid(row=4, column=0, columnspan=3, sticky="nw")
        self.last_drawing = None
        self.refresh()

    # ---- dataset and table -------------------------------------------------------------------------------------

    def refresh(self) -> None:
        self.state.unbind_prefix("e2v.datasets.")
        for child in self.dataset_frame.winfo_children():
            child.destroy()
        if self.controller.has_dataset():
            self._elements_table(self.dataset_frame)
            settings = ctk.CTkFrame(self.dataset_frame, fg_color="transparent")
            settings.grid(row=2, column=0, sticky="nw")
            render_section(settings, self.state, DATASET, fields=self.app.fields, title="dataset 0 (inline)",
                           width=200, error_width=200)   # two sections side by side: both fit the window
            processors = ctk.CTkFrame(self.dataset_frame, fg_color="transparent")
            processors.grid(row=2, column=1, sticky="nw", padx=10)
            row = render_section(processors, self.state, f"{DATASET}.processors.vae", fields=self.app.fields,
                                 title="VAE processor", width=160, error_width=200)
            render_section(processors, self.state, f"{DATASET}.processors.clip", start_row=row,
                           fields=self.app.fields, title="CLIP processor", width=160, error_width=200)
        self._present_toggles()
        self.check()
        self.draw()

    def _elements_table(self, master) -> None:
        ctk.CTkLabel(master, text="elements", font=ctk.CTkFont(weight="bold")).grid(row=0, column=0, sticky="w",
                                                                                   padx=8, pady=(10, 2))
        table = ctk.CTkFrame(master)
        table.grid(row=1, column=0, columnspan=2, sticky="w", padx=8)
        for column, title in enumerate(("", "name", "suffixes", "required", "position", "repeat", "VAE preprocess",
                                        "CLIP preprocess", "")):
            ctk.CTkLabel(table, text=title, font=ctk.CTkFont(size=12, weight="bold")).grid(row=0, column=column,
                                                                                          padx=3)
        for index, element in enumerate(self.controller.elements()):
            base = f"{DATASET}.elements.{index}"
            tk.Frame(table, width=14, height=14, background=SLOT_COLOURS[
                (element.get("vae") or {}).get("position", index) % len(SLOT_COLOURS)]).grid(row=index + 1, column=0,
                                                                                            padx=4)
            for column, (name, width) in enumerate((("name", 130), ("suffixes", 220), ("required", 0),
                                                   ("vae.position", 60), ("vae.repeat", 60),
                                                   ("vae.preprocess", 120)), start=1):
                cell = ctk.CTkFrame(table, fg_color="transparent")
                cell.grid(row=index + 1, column=column, padx=2, pady=2)
                field = BoundField(cell, self.state, f"{base}.{name}", 0, label="", width=width or 60, label_width=0)
                field.label.grid_remove()
                self.app.fields[f"{base}.{name}"] = field
            clip = element.get("clip")
            current = "off" if clip is False or clip is None else ((clip or {}).get("preprocess") or "default")
            menu = ctk.CTkOptionMenu(table, values=["off", "default", *PREPROCESS], width=120,
                                     command=lambda value, i=index: self._set_clip(i, value))
            menu.set(current)
            menu.grid(row=index + 1, column=7, padx=2)
            button(table, "✕", lambda i=index: self.remove_element(i), width=28, fg_color="#7f3030").grid(
                row=index + 1, column=8, padx=2)

    def _set_clip(self, index: int, value: str) -> None:
        clip = False if value == "off" else {"preprocess": None if value == "default" else value}
        self.state.set(f"{DATASET}.elements.{index}.clip", clip)

    def _present_toggles(self) -> None:
        for child in self.present_frame.winfo_children():
            child.destroy()
        self.present_vars = []
        elements = sorted(self.controller.elements(), key=lambda e: (e.get("vae") or {}).get("position", 0))
        for column, element in enumerate(elements):
            variable = tk.BooleanVar(value=True)
            self.present_vars.append(variable)
            box = ctk.CTkCheckBox(self.present_frame, text=str(element.get("name")), variable=variable,
                                  command=self.draw, width=20)
            box.grid(row=0, column=column, padx=3)
            if element.get("required"):
                box.configure(state="disabled")

    # ---- actions ------------------------------------------------------------------------------------------------

    def ask_import(self) -> None:
        path = filedialog.askopenfilename(parent=self.app, filetypes=[("E2V dataset config", "*.json")])
        if path:
            self.import_file(path)

    def import_file(self, path: str) -> None:
        try:
            count = self.controller.import_file(path)
        except ConfigError as error:
            self.app.show_dialog("Cannot import", str(error))
            return
        self.app.log(f"imported {count} E2V dataset(s) from {path}")
        self.refresh()

    def ask_export(self) -> None:
        path = filedialog.asksaveasfilename(parent=self.app, defaultextension=".json",
                                            filetypes=[("E2V dataset config", "*.json")])
        if path:
            try:
                self.controller.export_file(path)
            except ConfigError as error:
                self.app.show_dialog("Cannot export", str(error))
                return
            self.app.log(f"exported the E2V datasets to {path}")

    def new_dataset(self) -> None:
        self.controller.ensure_dataset()
        self.refresh()

    def add_element(self) -> None:
        self.controller.add_element()
        self.refresh()

    def remove_element(self, index: int) -> None:
        self.controller.remove_element(index)
        self.refresh()

    def redraw_random(self) -> None:
        self.controller.redraw_random()
        self.draw()

    def on_config_change(self, path: str) -> None:
        if path.startswith("e2v") or path in ("", "data.frame_buckets"):
            if path.endswith((".position", ".name", ".required")) or path in ("", "e2v.datasets"):
                self._present_toggles()
            self.check()
            self.draw()

    def check(self) -> None:
        problems = self.controller.problems()
        self.state.add_problems(problems, source="e2v")
        self.problem_label.configure(text="\n".join(problems))

    # ---- the drawing --------------------------------------------------------------------------------------------

    def draw(self) -> None:
        canvas = self.canvas
        canvas.delete("all")
        choices = [str(f) for f in self.controller.frame_choices()] or ["17"]
        self.frames_menu.configure(values=choices)
        if not self.controller.enabled():
            canvas.create_text(10, 10, anchor="nw", fill="#aaaaaa",
                               text="no E2V dataset: import a JSON config or press New dataset")
            return
        present = [v.get() for v in self.present_vars] or None
        if self.frames_menu.get() not in choices:
            # the smallest frame bucket that holds the reference frames
            try:
                needed = self.controller.dataset_config(for_drawing=True).num_reference_frames
            except ConfigError:
                needed = 1
            self.frames_menu.set(next((c for c in choices if int(c) >= needed), choices[-1]))
        try:
            drawing = self.controller.drawing(int(self.frames_menu.get()), present)
        except (ConfigError, ValueError) as error:
            canvas.create_text(10, 10, anchor="nw", fill=ERROR_COLOR, text=str(error), width=1080)
            return
        self.last_drawing = drawing
        left, top = 200, 18
        canvas.create_text(8, top + CELL / 2, anchor="w", fill="#dddddd", text="mini-video (pixel frames)")
        for frame, slot in enumerate(drawing.slot_of_frame):
            colour = "#7f7f7f" if slot is None else SLOT_COLOURS[slot % len(SLOT_COLOURS)]
            x = left + frame * (CELL + 2)
            canvas.create_rectangle(x, top, x + CELL, top + CELL, fill=colour, outline="#111111")
            if frame % 4 == 0:
                canvas.create_text(x + CELL / 2, top - 2, anchor="s", fill="#888888", text=str(frame),
                                   font=("TkDefaultFont", 7))
        mask_top = top + CELL + 30
        canvas.create_text(8, mask_top - 10, anchor="w", fill="#dddddd", text="mask over latent frames")
        stride = len(drawing.latent_mask)
        for channel, values in enumerate(drawing.latent_mask):
            y = mask_top + channel * (CELL // 2 + 2)
            canvas.create_text(left - 6, y + CELL / 4, anchor="e", fill="#888888", text=f"ch {channel}",
                               font=("TkDefaultFont", 7))
            for latent, value in enumerate(values):
                # a latent frame spans the width of the pixel frames it encodes (frame 0 alone, then 4 each)
                x = left + (0 if latent == 0 else (1 + (latent - 1) * stride)) * (CELL + 2)
                width = CELL if latent == 0 else stride * (CELL + 2) - 2
                canvas.create_rectangle(x, y, x + width, y + CELL // 2, outline="#111111",
                                        fill="#f0f0f0" if value >= 0.5 else "#303030")
        legend_y = mask_top + stride * (CELL // 2 + 2) + 10
        for slot, (name, kept) in enumerate(zip(drawing.names, drawing.kept)):
            x = left + slot * 170
            canvas.create_rectangle(x, legend_y, x + 12, legend_y + 12, fill=SLOT_COLOURS[slot % len(SLOT_COLOURS)])
            canvas.create_text(x + 16, legend_y + 6, anchor="w", fill="#dddddd",
                               text=f"slot {slot}: {name}" + ("" if kept else " (dropped)"))
