"""The sampling tab: sampling settings, the sample list editor, "sample now", and the preview player: the newest
sample of each prompt plays at its fps (PyAV-decoded frames on a CTkImage), with play / pause, loop, a slider
across the training steps at which samples were made, and an E2V sample's reference images beside it."""
from __future__ import annotations

import json
import threading
import time
import tkinter as tk
from pathlib import Path

import customtkinter as ctk
from PIL import Image

from modules.ui.ctk_components import ERROR_COLOR, button, render_section
from modules.ui.SamplingController import (ACCELERATOR_FIELDS, PreviewPlayer, PreviewSeries, PreviewVideo,
                                          accelerator_fields, epoch_text, variant_editor_fields)

PLAYER_SIZE = 256
COLUMN_WIDTHS = {"enabled": 40, "prompt": 260, "negative_prompt": 120, "width": 55, "height": 55, "frames": 50,
                 "seed": 50, "steps": 45, "guidance": 50, "image": 110, "elements": 150}


def scaled(frame) -> Image.Image:
    """uint8 (H, W, 3) -> a PIL image whose longer side is PLAYER_SIZE (nearest: the pixels of a tiny preview stay
    sharp)."""
    image = Image.fromarray(frame)
    scale = PLAYER_SIZE / max(image.size)
    return image.resize((max(1, round(image.size[0] * scale)), max(1, round(image.size[1] * scale))),
                        Image.Resampling.NEAREST)


class CtkSamplingView:
    def __init__(self, frame, app):
        self.app, self.state, self.controller = app, app.config_state, app.sampling
        self.player = PreviewPlayer()
        self.series: list[PreviewSeries] = []
        self.current: PreviewSeries | None = None
        self.frames_shown = 0            # how many frames the player has put on screen (tests watch it change)
        self._preview_files: tuple = ()
        self._last_scan = 0.0
        self._tick_job = None
        self._shown: str | None = None   # _table_key() of what the table's widgets show (None: unknown)
        left = ctk.CTkFrame(frame, fg_color="transparent")
        left.grid(row=0, column=0, rowspan=2, sticky="nw")
        right = ctk.CTkFrame(frame)
        right.grid(row=0, column=1, sticky="nw", padx=8)
        # under the player, so the sample list stays in view beside it
        below_player = ctk.CTkFrame(frame, fg_color="transparent")
        below_player.grid(row=1, column=1, sticky="nw", padx=8, pady=6)
        row = render_section(left, self.state, "sampling", fields=app.fields, title="sampling", width=160,
                             error_width=300)   # beside the player: the tab fits the window
        render_section(below_player, self.state, "sampling.accelerator", only=ACCELERATOR_FIELDS,
                       fields=app.fields, title="accelerator (step-distill LoRA, docs/distilled.md)", width=120,
                       error_width=160)   # narrow: beside the sampling fields, the tab fits the window
        self._show_accelerator_fields()
        bar = ctk.CTkFrame(left, fg_color="transparent")
        bar.grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=6)
        button(bar, "Sample now", lambda: app.request("sample")).grid(row=0, column=0, padx=3)
        button(bar, "Add sample", self.add_sample).grid(row=0, column=1, padx=3)
        button(bar, "Save samples", self.save_samples).grid(row=0, column=2, padx=3)
        self.samples_label = ctk.CTkLabel(left, text="", anchor="w", justify="left", wraplength=700)
        self.samples_label.grid(row=row + 1, column=0, columnspan=3, sticky="w", padx=8)
        self.table = ctk.CTkScrollableFrame(left, width=620, height=260, orientation="horizontal")
        self.table.grid(row=row + 2, column=0, columnspan=3, sticky="w", padx=8, pady=4)
        self._build_player(right)
        self.reload_samples()

    # ---- the sample list ----------------------------------------------------------------------------------------

    def reload_samples(self) -> None:
        """The samples file read again; the table is drawn again only where it would show something else (a run's
        start reloads it, and drawing a row of CTk entries blocks the main loop for tens of ms)."""
        from modules.ui.model_parts import detected_variant
        self.controller.load_samples()
        columns = variant_editor_fields(detected_variant(self.state))
        if self._shown != self._table_key(columns):
            self._render_table(columns)

    def _table_key(self, columns) -> str:
        """What the table shows: the rows, their columns, the file and its problem."""
        return json.dumps([self.controller.samples, list(columns), str(self.controller.samples_file()),
                           self.controller.problem], sort_keys=True, default=str)

    def _render_table(self, columns: tuple[str, ...] | None = None) -> None:
        """`columns`: the variant's editor fields when the caller has them (detecting the variant reads the model's
        config)."""
        from modules.ui.model_parts import detected_variant
        for child in self.table.winfo_children():
            child.destroy()
        # a VACE or Animate model's samples also take their conditions (control video, pose video, ...)
        self.columns = columns if columns is not None else variant_editor_fields(detected_variant(self.state))
        self._shown = self._table_key(self.columns)
        for column, name in enumerate(self.columns):
            ctk.CTkLabel(self.table, text=name.replace("_", " "), font=ctk.CTkFont(size=12, weight="bold"),
                         width=COLUMN_WIDTHS.get(name, 120), anchor="w").grid(row=0, column=column, padx=2)
        for index, sample in enumerate(self.controller.samples):
            for column, name in enumerate(self.columns):
                self._cell(index, column, name, sample.get(name))
            button(self.table, "✕", lambda i=index: self.remove_sample(i), width=28, fg_color="#7f3030").grid(
                row=index + 1, column=len(self.columns), padx=2)
        # as high as its rows: the sideways scrollbar sits right under the last row, in view, and no row is clipped
        self.table.configure(height=36 + 36 * max(1, len(self.controller.samples)))
        where = self.controller.samples_file()
        text = f"samples file: {where}" + ("" if where.is_file() else " (written by Save samples)")
        self.samples_label.configure(text=text + (f"\n{self.controller.problem}" if self.controller.problem else ""),
                                     text_color=ERROR_COLOR if self.controller.problem else ("gray10", "gray90"))

    def follow_model(self) -> None:
        """Another base model: the sample list gains or drops its condition columns."""
        from modules.ui.model_parts import detected_variant
        columns = variant_editor_fields(detected_variant(self.state))
        if columns != getattr(self, "columns", None):
            self._render_table(columns)
        self._show_accelerator_fields()

    def _show_accelerator_fields(self) -> None:
        """The low-noise expert's accelerator file only for a two-expert model."""
        from modules.ui.model_parts import detected_variant
        shown = accelerator_fields(detected_variant(self.state))
        for name in ACCELERATOR_FIELDS:
            self.app.fields[f"sampling.accelerator.{name}"].set_visible(name in shown)

    def _cell(self, index: int, column: int, name: str, value) -> None:
        if name == "enabled":
            variable = tk.BooleanVar(value=bool(value))
            widget = ctk.CTkCheckBox(self.table, text="", variable=variable, width=30,
                                     command=lambda: self._set(index, name, variable.get(), None))
        else:
            text = json.dumps(value) if name == "elements" else ", ".join(value) if isinstance(value, list) else \
                ("" if value is None else str(value))
            variable = tk.StringVar(value=text)
            widget = ctk.CTkEntry(self.table, textvariable=variable, width=COLUMN_WIDTHS.get(name, 120))
            widget.bind("<FocusOut>", lambda _e: self._set(index, name, variable.get(), widget), add="+")
            widget.bind("<Return>", lambda _e: self._set(index, name, variable.get(), widget), add="+")
        widget.grid(row=index + 1, column=column, padx=2, pady=2)

    def _set(self, index: int, name: str, text, widget) -> None:
        value = text
        if name == "elements":
            try:
                value = json.loads(text or "{}")
            except json.JSONDecodeError:
                value = text
        elif name == "reference_images":   # VACE's references, in order: comma separated in the cell
            value = [part.strip() for part in text.split(",") if part.strip()]
        message = self.controller.set_field(index, name, value)
        # the entry shows the edit: the table matches the list again, or (refused) shows what the list does not hold
        self._shown = None if message else self._table_key(self.columns)
        if widget is not None:
            widget.configure(border_color=ERROR_COLOR if message else ctk.ThemeManager.theme["CTkEntry"]
                             ["border_color"])
        if message:
            self.app.log(f"sample {index}: {message}")

    def add_sample(self) -> None:
        self.controller.add_sample()
        self._render_table()

    def remove_sample(self, index: int) -> None:
        self.controller.remove_sample(index)
        self._render_table()

    def save_samples(self) -> None:
        path = self.controller.save_samples()
        self.app.log(f"samples written to {path}")
        self._render_table()

    # ---- the player ---------------------------------------------------------------------------------------------

    def _build_player(self, master) -> None:
        ctk.CTkLabel(master, text="preview", font=ctk.CTkFont(weight="bold")).grid(row=0, column=0, sticky="w",
                                                                                  padx=6, pady=4)
        self.series_menu = ctk.CTkOptionMenu(master, values=["(no previews yet)"], width=320,
                                             command=self._choose_series)
        self.series_menu.grid(row=1, column=0, columnspan=2, sticky="w", padx=6)
        self.video_label = ctk.CTkLabel(master, text="previews appear here while training samples",
                                        width=PLAYER_SIZE, height=PLAYER_SIZE, fg_color="#111111",
                                        text_color="#cccccc")   # the player is black in both modes
        self.video_label.grid(row=2, column=0, padx=6, pady=6)
        self.references = ctk.CTkFrame(master, fg_color="transparent")
        self.references.grid(row=2, column=1, sticky="n", padx=4, pady=6)
        # a VACE / Animate sample's control or pose video, on the preview's frame (shown when the sample has one)
        self.driving_label = ctk.CTkLabel(master, text="", width=PLAYER_SIZE, height=PLAYER_SIZE,
                                          fg_color="#111111")
        self._driving_images: list[ctk.CTkImage] = []
        controls = ctk.CTkFrame(master, fg_color="transparent")
        controls.grid(row=3, column=0, columnspan=2, sticky="w", padx=6)
        self.play_button = button(controls, "Pause", self.toggle_play, width=70)
        self.play_button.grid(row=0, column=0, padx=3)
        self.loop_var = tk.BooleanVar(value=True)
        ctk.CTkCheckBox(controls, text="loop", variable=self.loop_var, command=self._set_loop).grid(row=0, column=1,
                                                                                                  padx=6)
        self.step_slider = ctk.CTkSlider(master, from_=0, to=1, number_of_steps=1, command=self._choose_step,
                                         width=320)
        self.step_slider.grid(row=4, column=0, columnspan=2, sticky="w", padx=6, pady=4)
        self.step_label = ctk.CTkLabel(master, text="", anchor="w")
        self.step_label.grid(row=5, column=0, columnspan=2, sticky="w", padx=6)
        self._frame_images: list[ctk.CTkImage] = []
        self._generation = 0
        self._reference_images = []

    def poll(self) -> None:
        """From the main window's poll: look for new preview files about once a second."""
        if time.monotonic() - self._last_scan >= 1.0:
            self.refresh_previews()

    def refresh_previews(self) -> None:
        self._last_scan = time.monotonic()
        series = self.controller.previews()
        files = tuple(str(v.path) for s in series for v in s.videos)
        if files == self._preview_files:
            return
        self._preview_files = files
        self.series = series
        names = [s.name for s in series] or ["(no previews yet)"]
        self.series_menu.configure(values=names)
        keep = self.current.name if self.current else None
        chosen = next((s for s in series if s.name == keep), series[0] if series else None)
        if chosen is not None:
            self.series_menu.set(chosen.name)
            self._show_series(chosen, newest=True)

    def show_video(self, path) -> None:
        """A preview chosen in the gallery: its sample in the menu and its step on the slider (the series of its
        run, an earlier one too), so the player's labels and slider are about the video that plays."""
        found = self.controller.locate(path)
        if found is None:   # a comparison grid: no sample, no steps
            self.current = None
            self.series_menu.set(Path(path).name)
            self._open(PreviewVideo(Path(path), 0, 0))
            return
        self.series, series, index = found
        self.series_menu.configure(values=[s.name for s in self.series])
        self.series_menu.set(series.name)
        self._show_series(series, newest=False, index=index)

    def _choose_series(self, name: str) -> None:
        chosen = next((s for s in self.series if s.name == name), None)
        if chosen is not None:
            self._show_series(chosen, newest=True)

    def _show_series(self, series: PreviewSeries, newest: bool, index: int | None = None) -> None:
        self.current = series
        count = len(series.videos)
        self.step_slider.configure(to=max(1, count - 1), number_of_steps=max(1, count - 1))
        if newest or index is not None:
            self.step_slider.set(count - 1 if index is None else index)
        self._open(series.videos[int(round(self.step_slider.get()))] if count else None)
        self._show_references(series)

    def _choose_step(self, value: float) -> None:
        if self.current is not None and self.current.videos:
            self._open(self.current.videos[min(int(round(value)), len(self.current.videos) - 1)])

    def _open(self, video) -> None:
        """Decodes in a thread (a long clip takes a while) and shows the result from the main loop."""
        if video is None:
            return
        self._generation += 1
        generation = self._generation
        result: list = []

        driving = self.controller.driving_video(self.current) if self.current is not None else ""

        def decode():  # no Tk call here: frames decoded and scaled to the player's size as PIL images
            try:
                frames, fps = PreviewPlayer.read(video.path)
                label = video.label()
                beside = [scaled(frame) for frame in PreviewPlayer.read(driving)[0]] if driving else []
                result.append((frames, fps, [scaled(frame) for frame in frames], beside, label))
            except Exception as error:  # a half-written or broken file must not break the tab
                result.append(error)

        def show():
            if generation != self._generation:
                return  # a newer video was chosen meanwhile
            if not result:
                self.video_label.after(30, show)
                return
            if isinstance(result[0], Exception):
                self.step_label.configure(text=f"cannot play {video.path}: {result[0]}")
                return
            frames, fps, images, beside, label = result[0]
            self.player.show(video.path, frames, fps)
            # one CTkImage per frame, made once: playing only switches between them (it caches its PhotoImage)
            self._frame_images = [ctk.CTkImage(light_image=image, dark_image=image, size=image.size)
                                  for image in images]
            self._driving_images = [ctk.CTkImage(light_image=image, dark_image=image, size=image.size)
                                    for image in beside]
            if beside:   # in the references' place: a VACE or Animate sample has no E2V references
                self.references.grid_remove()
                self.driving_label.grid(row=2, column=1, padx=6, pady=6)
            else:
                self.driving_label.grid_remove()
                self.references.grid()
            self.player.loop = self.loop_var.get()
            self.step_label.configure(text=f"step {video.step}, {epoch_text(video.step, video.epoch)}"
                                           f"{f' ({label})' if label else ''}: "
                                           f"{video.path.name} "
                                           f"({len(self.player.frames)} frames at {self.player.fps:.0f} fps)")
            self._render_frame()
            if self._tick_job is None:
                self._tick_job = self.video_label.after(self.player.interval_ms, self._tick)

        threading.Thread(target=decode, name="preview-decode", daemon=True).start()
        self.video_label.after(30, show)

    def _render_frame(self) -> None:
        if self.player.frame is None or not self._frame_images:
            return
        self.video_label.configure(image=self._frame_images[self.player.index], text="")
        if self._driving_images:   # the same moment of the control or pose video
            self.driving_label.configure(
                image=self._driving_images[min(self.player.index, len(self._driving_images) - 1)], text="")
        self.frames_shown += 1

    def _tick(self) -> None:
        self._tick_job = None
        if not self.video_label.winfo_exists():
            return
        if self.player.tick():
            self._render_frame()
        self._tick_job = self.video_label.after(self.player.interval_ms, self._tick)

    def toggle_play(self) -> None:
        self.player.playing = not self.player.playing
        self.play_button.configure(text="Pause" if self.player.playing else "Play")

    def _set_loop(self) -> None:
        self.player.loop = self.loop_var.get()
        if self.player.loop and not self.player.playing:
            self.player.playing = True
            self.play_button.configure(text="Pause")

    def _show_references(self, series: PreviewSeries) -> None:
        for child in self.references.winfo_children():
            child.destroy()
        self._reference_images = []
        references = self.controller.references(series)
        if references:
            ctk.CTkLabel(self.references, text="E2V references").grid(row=0, column=0, sticky="w")
        for row, (name, path) in enumerate(references.items(), start=1):
            try:
                image = Image.open(path).convert("RGB")
            except OSError:
                continue
            image.thumbnail((110, 110))
            picture = ctk.CTkImage(light_image=image, dark_image=image, size=image.size)
            self._reference_images.append(picture)
            ctk.CTkLabel(self.references, image=picture, text=name, compound="top").grid(row=row, column=0, pady=3)
