"""The training tab: run length, batch, dtype and memory settings, the optimizer, the timestep distribution with a
plot of its density (drawn from the project's own sampler), and every config field no other tab places (so a new
setting is never hidden)."""
from __future__ import annotations

import json
import tkinter as tk
from pathlib import Path

import customtkinter as ctk

from modules.ui.config_fields import section_fields
from modules.ui.ctk_components import draw_bars, render_section
from modules.ui.plot_data import timestep_density
from modules.util.config.config_io import ConfigError

# config sections and fields that change the memory a step needs (the memory line is re-planned when they change)
MEMORY_PATHS = {"model", "training_method", "lora", "fine_tune", "optimizer", "performance", "data", "batch_size",
                "gradient_checkpointing", "train_dtype", "expert", "multi_gpu", "distributed", "distill"}
RUN_FIELDS = ["epochs", "max_steps", "batch_size", "train_dtype", "gradient_checkpointing", "expert"]
# top-level fields and sections that other tabs (or the top bar) show
PLACED_ELSEWHERE = {"model_type", "training_method", "model", "output", "workspace_dir", "cache_dir", "tensorboard",
                    "demo_assets", "seed", "device", "data", "lora", "fine_tune", "embedding", "sampling", "backup",
                    "e2v", "optimizer", "timestep", "animate", "multi_gpu", "distributed", "remote"} | set(RUN_FIELDS)


class CtkTrainingTabView:
    def __init__(self, frame, app):
        self.app, self.state = app, app.config_state
        left = ctk.CTkFrame(frame, fg_color="transparent")
        left.grid(row=0, column=0, sticky="nw")
        right = ctk.CTkFrame(frame, fg_color="transparent")
        right.grid(row=0, column=1, sticky="nw", padx=10)
        row = render_section(left, self.state, "", only=RUN_FIELDS, fields=app.fields, title="run", width=180,
                             error_width=230)
        row = render_section(left, self.state, "data", only=["ti2v_image_probability"], start_row=row,
                             fields=app.fields, width=180, error_width=230)
        row = render_section(left, self.state, "optimizer", start_row=row, fields=app.fields, title="optimizer",
                             width=180, error_width=230)
        others = [spec for spec in section_fields("") if spec.name not in PLACED_ELSEWHERE]
        simple = [spec.name for spec in others if spec.simple]
        if simple:
            row = render_section(left, self.state, "", only=simple, start_row=row, fields=app.fields,
                                 title="more settings", width=180, error_width=230)
        for spec in others:
            if spec.kind == "section":
                row = render_section(left, self.state, spec.path, start_row=row, fields=app.fields,
                                     title=spec.name.replace("_", " "), width=180, error_width=230)

        row = render_section(right, self.state, "timestep", fields=app.fields, title="timestep distribution",
                             width=160, error_width=200)
        ctk.CTkLabel(right, text="density of training sigmas (20000 draws of the trainer's sampler)",
                     anchor="w").grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=(8, 0))
        self.density_canvas = tk.Canvas(right, width=380, height=160, background="#1d1d1d", highlightthickness=0)
        self.density_canvas.grid(row=row + 1, column=0, columnspan=3, sticky="w", padx=8, pady=4)
        self.density_note = ctk.CTkLabel(right, text="", anchor="w")
        self.density_note.grid(row=row + 2, column=0, columnspan=3, sticky="w", padx=8)
        self.density: list[float] = []
        frame.after_idle(self.draw_density)
        self._memory_plan(right, row + 3)
        from modules.ui.CtkMultiGpuSection import CtkMultiGpuSection
        self.multi_gpu = CtkMultiGpuSection(right, app, row + 4)
        app.build_remote_section(right, row + 5)

    def _memory_plan(self, parent, row: int) -> None:
        """The predicted peak of the config being edited against a card size, and "fit to my card" with its
        objective, progress and cancel (MemoryPlanController: planning runs in a worker thread)."""
        from modules.ui.MemoryPlanController import OBJECTIVES, MemoryPlanController
        self.memory = MemoryPlanController(self.state)
        box = ctk.CTkFrame(parent, fg_color="transparent")
        box.grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=(12, 0))
        ctk.CTkLabel(box, text="card GiB").grid(row=0, column=0, sticky="w")
        self.memory_gib = ctk.CTkEntry(box, width=60)
        self.memory_gib.insert(0, "24")
        self.memory_gib.grid(row=0, column=1, padx=4)
        # the line follows the box: the kept prediction against the new size, no new trace
        self.memory_gib.bind("<KeyRelease>", lambda _e: self._card_changed(), add="+")
        ctk.CTkButton(box, text="predict memory", width=120,
                      command=lambda: self.memory.predict(self._card_gib())).grid(row=0, column=2, padx=4)
        ctk.CTkButton(box, text="fit to my card", width=120, command=self.fit_to_card).grid(row=0, column=3, padx=4)
        self.objective_menu = ctk.CTkOptionMenu(box, values=list(OBJECTIVES), width=150)
        self.objective_menu.grid(row=1, column=3, padx=4, pady=(4, 0))
        self.cancel_button = ctk.CTkButton(box, text="cancel", width=120, command=self.memory.cancel,
                                           state="disabled")
        self.cancel_button.grid(row=1, column=2, padx=4, pady=(4, 0))
        # wrapped: a long line ("not planned: ...") widened the box and pushed "fit to my card" out of view
        self.memory_label = ctk.CTkLabel(box, text=self.memory.text, anchor="w", justify="left", wraplength=540)
        self.memory_label.grid(row=2, column=0, columnspan=4, sticky="w", pady=(4, 0))
        self.memory_details = ctk.CTkLabel(box, text="", anchor="w", justify="left", wraplength=540)
        self.memory_details.grid(row=3, column=0, columnspan=4, sticky="w")
        self._poll_memory(box)

    def fit_to_card(self) -> None:
        from modules.ui.MemoryPlanController import OBJECTIVES
        self.memory.fit(self._card_gib() or 24.0, OBJECTIVES[self.objective_menu.get()])

    def _card_changed(self) -> None:
        self.memory.card_changed(self._card_gib())
        self.memory_label.configure(text=self.memory.text)

    def _card_gib(self) -> float | None:
        try:
            return float(self.memory_gib.get())
        except ValueError:
            return None

    def _poll_memory(self, widget) -> None:
        text = self.memory.poll()
        if self.memory.busy:
            self.memory_label.configure(text=self.memory.status())
        else:
            self.memory_label.configure(text=self.memory.text if text is None else text)
        if text is not None:
            self.memory_details.configure(text="\n".join(f"- {line}" for line in self.memory.details))
        self.cancel_button.configure(state="normal" if self.memory.busy else "disabled")
        widget.after(300, lambda: self._poll_memory(widget))

    def on_config_change(self, path: str) -> None:
        if path.startswith("timestep.") or path in ("", "expert", "model.base_model_name"):
            self.draw_density()
        if path == "" or path.split(".")[0] in MEMORY_PATHS:
            self.replan_soon()
        self.multi_gpu.on_config_change(path)

    def replan_soon(self) -> None:
        """The memory line follows the config: a new prediction a second after the last change."""
        if getattr(self, "_replan", None) is not None:
            self.memory_label.after_cancel(self._replan)
        self._replan = self.memory_label.after(1000, self._replan_now)

    def _replan_now(self) -> None:
        self._replan = None
        if not self.memory.predict(self._card_gib()) and self.memory.busy:
            self.replan_soon()   # one is running: plan again once it is done

    def _boundary(self) -> float | None:
        index = Path(self.state.get("model.base_model_name") or "") / "model_index.json"
        try:
            return json.loads(index.read_text(encoding="utf-8")).get("boundary_ratio") if index.is_file() else None
        except (OSError, json.JSONDecodeError):
            return None

    def draw_density(self) -> None:
        try:
            config = self.state.config()
        except ConfigError:
            self.density_note.configure(text="(fix the timestep fields to see the density)")
            return
        try:
            self.density = timestep_density(config.timestep, expert=config.expert, boundary=self._boundary())
        except ValueError as error:
            self.density_note.configure(text=str(error))
            return
        self.density_note.configure(text=f"{config.timestep.distribution}; sigma 0 (clean) to 1 (noise)")
        draw_bars(self.density_canvas, self.density, x_range=("0", "1"))
