"""The main window, in OneTrainer's shape: a top bar (presets, load, save as, model type, training method, detected
variant), the tabs, and a bottom bar (status, step and epoch progress, s/step, ETA, live loss curve, Start / Stop)
over a log pane. Every widget is touched from the Tk main loop only: the training worker's events are drained by
`_poll`, scheduled with `after`."""
from __future__ import annotations

import time
import tkinter as tk
from pathlib import Path
from tkinter import filedialog

import customtkinter as ctk

from modules.ui.ConceptController import ConceptController
from modules.ui.ctk_components import BoundField, button, draw_line_plot, render_section, scrollable_tab
from modules.ui.ElementsController import ElementsController
from modules.ui.SamplingController import SamplingController
from modules.ui.TrainController import TrainController, format_duration
from modules.util.config.config_io import ConfigError

POLL_MS = 100
TABS = ("general", "model", "concepts", "elements", "training", "LoRA / embedding", "sampling", "backup", "tools")


class CtkTrainView(ctk.CTk):
    def __init__(self, controller: TrainController | None = None, restore_last_used: bool = True):
        ctk.set_appearance_mode("dark")  # the plots are drawn on dark canvases
        super().__init__()
        self.title("Wan trainer")
        self.geometry("1280x900")
        self.minsize(1000, 700)
        self.controller = controller or TrainController()
        self.config_state = self.controller.state
        self.concepts = ConceptController(self.config_state)
        self.elements = ElementsController(self.config_state)
        self.sampling = SamplingController(self.config_state)
        self.fields: dict[str, BoundField] = {}
        self.dialogs: list[ctk.CTkToplevel] = []
        self._drawn_losses = 0
        self.grid_columnconfigure(0, weight=1)
        self.grid_rowconfigure(1, weight=1)
        if restore_last_used:
            self.controller.restore_last_used()
        self._build_top_bar()
        self._build_tabs()
        self._build_bottom_bar()
        self.config_state.on_change(self._on_config_change)
        self.protocol("WM_DELETE_WINDOW", self.close)
        self._update_variant()
        self.preloaded = False
        self.after(200, self._preload)
        self.after(POLL_MS, self._poll)

    def _preload(self) -> None:
        self.status_label.configure(text="loading the trainer's libraries…")
        self.update_idletasks()
        self.controller.preload()
        self.preloaded = True
        self.status_label.configure(text="idle")

    # ---- top bar ------------------------------------------------------------------------------------------------

    def _build_top_bar(self) -> None:
        bar = ctk.CTkFrame(self)
        bar.grid(row=0, column=0, sticky="ew", padx=6, pady=(6, 2))
        self.preset_paths = {}
        for folder, paths in self.controller.preset_tree().items():
            for path in paths:
                name = path.stem if not folder else f"{folder} / {path.stem}"
                self.preset_paths[name] = path
        self.preset_menu = ctk.CTkOptionMenu(bar, values=list(self.preset_paths) or ["(no presets)"], width=260,
                                             command=self.load_preset)
        self.preset_menu.set(self.controller.current_path.stem if self.controller.current_path else "presets")
        self.preset_menu.grid(row=0, column=0, padx=4, pady=4)
        button(bar, "Load…", self._ask_load, width=70).grid(row=0, column=1, padx=2)
        button(bar, "Save as…", self._ask_save, width=80).grid(row=0, column=2, padx=2)
        self.fields["model_type"] = BoundField(bar, self.config_state, "model_type", 0, label="model type", width=130,
                                               column=3, label_width=70)
        self.fields["training_method"] = BoundField(bar, self.config_state, "training_method", 0, label="method",
                                                    width=120, column=6, label_width=50)
        self.variant_label = ctk.CTkLabel(bar, text="", anchor="w")
        self.variant_label.grid(row=0, column=9, padx=8, sticky="w")
        bar.grid_columnconfigure(9, weight=1)

    def load_preset(self, name: str) -> None:
        self.load_file(self.preset_paths[name])

    def load_file(self, path: str | Path) -> None:
        try:
            self.controller.load(path)
        except ConfigError as error:
            self.show_dialog("Cannot load", str(error))
            return
        self.log(f"loaded {path}")
        self.preset_menu.set(Path(path).stem)
        self.refresh_lists()
        self._update_variant()

    def _ask_load(self) -> None:
        path = filedialog.askopenfilename(parent=self, filetypes=[("config", "*.json")],
                                          initialdir=str(self.controller.presets_dir))
        if path:
            self.load_file(path)

    def _ask_save(self) -> None:
        path = filedialog.asksaveasfilename(parent=self, defaultextension=".json", filetypes=[("config", "*.json")],
                                            initialdir=str(self.controller.presets_dir))
        if path:
            self.save_as(path)

    def save_as(self, path: str | Path) -> None:
        self.controller.save_as(path)
        self.log(f"saved {path}" + ("" if not self.config_state.problems else
                                    f" (with {len(self.config_state.problems)} problem(s) still to fix)"))

    def _update_variant(self) -> None:
        self.variant_label.configure(text=f"variant: {self.controller.detect_variant()}")

    # ---- tabs ---------------------------------------------------------------------------------------------------

    def _build_tabs(self) -> None:
        from modules.ui.CtkConceptsView import CtkConceptsView
        from modules.ui.CtkElementsView import CtkElementsView
        from modules.ui.CtkSamplingView import CtkSamplingView
        from modules.ui.CtkToolsView import CtkToolsView
        from modules.ui.CtkTrainingTabView import CtkTrainingTabView

        self.tabview = ctk.CTkTabview(self)
        self.tabview.grid(row=1, column=0, sticky="nsew", padx=6, pady=2)
        self.tabs = {name: scrollable_tab(self.tabview, name) for name in TABS}

        general = self.tabs["general"]
        row = render_section(general, self.config_state, "", only=["workspace_dir", "cache_dir", "device", "seed",
                                                               "tensorboard", "demo_assets"], fields=self.fields)
        row = render_section(general, self.config_state, "data", only=["dataloader_threads"], start_row=row,
                             fields=self.fields)
        button(general, "Start TensorBoard", self.start_tensorboard, width=160).grid(row=row, column=1, sticky="w",
                                                                                    padx=4, pady=8)
        self.tensorboard_label = ctk.CTkLabel(general, text="")
        self.tensorboard_label.grid(row=row, column=2, sticky="w")

        model = self.tabs["model"]
        row = render_section(model, self.config_state, "model",
                             only=["base_model_name", "allow_download", "intended_variant"], fields=self.fields,
                             title="base model")
        from modules.ui.CtkModelPartPicker import CtkModelPartPicker
        self.part_pickers = [CtkModelPartPicker(model, self.config_state, "base", row)]
        row += 1
        for part in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder", "tokenizer"):
            row = render_section(model, self.config_state, f"model.{part}", start_row=row, fields=self.fields,
                                 title=part.replace("_", " "))
            self.part_pickers.append(CtkModelPartPicker(model, self.config_state, part, row))
            row += 1
        render_section(model, self.config_state, "output", start_row=row, fields=self.fields, title="output")

        self.concepts_view = CtkConceptsView(self.tabs["concepts"], self)
        self.elements_view = CtkElementsView(self.tabs["elements"], self)
        self.training_view = CtkTrainingTabView(self.tabs["training"], self)
        self.method_frame = self.tabs["LoRA / embedding"]
        self._render_method_tab()
        self.sampling_view = CtkSamplingView(self.tabs["sampling"], self)

        backup = self.tabs["backup"]
        row = render_section(backup, self.config_state, "backup", fields=self.fields)
        buttons = ctk.CTkFrame(backup, fg_color="transparent")
        buttons.grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=10)
        button(buttons, "Backup now", lambda: self.request("backup")).grid(row=0, column=0, padx=4)
        button(buttons, "Save now", lambda: self.request("save")).grid(row=0, column=1, padx=4)
        self.tools_view = CtkToolsView(self.tabs["tools"], self)

    def _render_method_tab(self) -> None:
        frame = self.method_frame
        for child in frame.winfo_children():
            child.destroy()
        for section in ("lora", "embedding", "fine_tune"):
            self.config_state.unbind_prefix(f"{section}.")
        method = self.config_state.get("training_method")
        section = {"LORA": "lora", "EMBEDDING": "embedding", "FINE_TUNE": "fine_tune"}.get(method, "lora")
        title = {"lora": "LoRA", "embedding": "embedding", "fine_tune": "fine-tune"}[section]
        render_section(frame, self.config_state, section, fields=self.fields, title=title)
        self._method_shown = method

    def refresh_lists(self) -> None:
        """After a load: the parts drawn per list item (concept cards, elements, samples) are drawn again."""
        self.concepts_view.refresh()
        self.elements_view.refresh()
        self.sampling_view.reload_samples()
        if self.config_state.get("training_method") != self._method_shown:
            self._render_method_tab()

    def _on_config_change(self, path: str) -> None:
        if path == "training_method" and self.config_state.get("training_method") != self._method_shown:
            self._render_method_tab()
        if path.startswith("model.") or path in ("", "demo_assets", "model_type"):
            self._update_variant()
            for picker in self.part_pickers:
                if path in ("", picker.field):
                    picker.refresh()
        if path in ("sampling.samples_file", "workspace_dir"):
            self.sampling_view.reload_samples()
        self.elements_view.on_config_change(path)
        self.training_view.on_config_change(path)

    def start_tensorboard(self) -> None:
        import subprocess
        import sys
        logdir = Path(self.config_state.get("workspace_dir") or "workspace") / "tensorboard"
        if getattr(self, "_tensorboard", None) is not None and self._tensorboard.poll() is None:
            return  # already serving; a second server would fight for the port
        try:
            self._tensorboard = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                                  "--port", "6006"], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL)
        except OSError as error:
            self.show_dialog("TensorBoard", f"cannot start TensorBoard: {error}")
            return
        self.tensorboard_label.configure(text=f"http://localhost:6006  ({logdir})")

    # ---- bottom bar ---------------------------------------------------------------------------------------------

    @staticmethod
    def _progress_row(bar, row: int, name: str):
        ctk.CTkLabel(bar, text=name, width=40).grid(row=row, column=0, sticky="w", padx=8)
        progress = ctk.CTkProgressBar(bar)
        progress.set(0)
        progress.grid(row=row, column=1, sticky="ew", padx=4)
        label = ctk.CTkLabel(bar, text="0 / 0", width=200, anchor="w")
        label.grid(row=row, column=2, sticky="w", padx=4)
        return progress, label

    def _build_bottom_bar(self) -> None:
        bar = ctk.CTkFrame(self)
        bar.grid(row=2, column=0, sticky="ew", padx=6, pady=2)
        bar.grid_columnconfigure(1, weight=1)
        self.status_label = ctk.CTkLabel(bar, text="idle", anchor="w")
        self.status_label.grid(row=0, column=0, columnspan=3, sticky="ew", padx=8)
        self.step_bar, self.step_label = self._progress_row(bar, 1, "step")
        self.epoch_bar, self.epoch_label = self._progress_row(bar, 2, "epoch")
        self.loss_canvas = tk.Canvas(bar, width=300, height=70, background="#1d1d1d", highlightthickness=0)
        self.loss_canvas.grid(row=0, column=3, rowspan=3, padx=6, pady=4)
        buttons = ctk.CTkFrame(bar, fg_color="transparent")
        buttons.grid(row=0, column=4, rowspan=3, padx=6)
        self.start_button = button(buttons, "Start", self.start, width=90, fg_color="#2e7d32",
                                   hover_color="#1b5e20")
        self.start_button.grid(row=0, column=0, pady=3)
        self.stop_button = button(buttons, "Stop", self.stop, width=90, fg_color="#b71c1c", hover_color="#7f0000",
                                  state="disabled")
        self.stop_button.grid(row=1, column=0, pady=3)
        self.log_box = ctk.CTkTextbox(self, height=90, wrap="word")
        self.log_box.grid(row=3, column=0, sticky="ew", padx=6, pady=(2, 6))
        self.log_box.configure(state="disabled")

    def log(self, text: str) -> None:
        self.log_box.configure(state="normal")
        self.log_box.insert("end", text.rstrip("\n") + "\n")
        self.log_box.see("end")
        self.log_box.configure(state="disabled")

    def show_dialog(self, title: str, text: str) -> ctk.CTkToplevel:
        """A message window that does not block the main loop (training and timers go on)."""
        dialog = ctk.CTkToplevel(self)
        dialog.title(title)
        dialog.geometry("+%d+%d" % (self.winfo_rootx() + 120, self.winfo_rooty() + 120))
        box = ctk.CTkTextbox(dialog, width=620, height=220, wrap="word")
        box.insert("end", text)
        box.configure(state="disabled")
        box.pack(padx=10, pady=10, fill="both", expand=True)
        button(dialog, "OK", dialog.destroy, width=80).pack(pady=(0, 10))
        dialog.transient(self)
        self.dialogs.append(dialog)
        return dialog

    # ---- actions ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        problems = self.controller.start()
        if problems:
            self.log("Start refused:\n" + "\n".join(f"  - {p}" for p in problems))
            self.show_dialog("Start refused", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in problems))
            return
        self._drawn_losses = 0
        self.loss_canvas.delete("all")
        self.start_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.log("training started")

    def stop(self) -> None:
        self.controller.stop()

    def request(self, action: str) -> None:
        message = self.controller.request(action)
        self.status_label.configure(text=message)
        self.log(message)

    def _poll(self) -> None:
        for kind, payload in self.controller.poll_events():
            if kind == "log":
                self.log(str(payload))
            elif kind == "refused":
                self._run_ended()
                self.log("Start refused:\n" + "\n".join(f"  - {p}" for p in payload))
                self.show_dialog("Start refused", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in payload))
            elif kind == "failed":
                self._run_ended()
                self.log(f"training failed: {payload}")
                self.show_dialog("Training failed", str(payload))
            elif kind == "finished":
                self._run_ended()
                self.log(self.controller.run.status)
        self._show_progress()
        self.sampling_view.poll()
        self.tools_view.poll()
        self.after(POLL_MS, self._poll)

    def _run_ended(self) -> None:
        self.start_button.configure(state="normal")
        self.stop_button.configure(state="disabled")
        self.sampling_view.refresh_previews()

    def _show_progress(self) -> None:
        run = self.controller.run
        self.status_label.configure(text=run.status)
        if run.total_steps:
            self.step_bar.set(run.step / run.total_steps)
            self.step_label.configure(text=f"{run.step} / {run.total_steps}   {run.seconds_per_step or 0:.2f} s/step"
                                           f"   ETA {format_duration(run.eta_seconds)}")
        if run.epochs:
            self.epoch_bar.set(run.epoch_fraction)
            self.epoch_label.configure(text=f"epoch {run.epoch + 1} / {run.epochs}")
        if len(run.losses) != self._drawn_losses:
            self._drawn_losses = len(run.losses)
            draw_line_plot(self.loss_canvas, run.losses, label="loss")

    def close(self) -> None:
        try:
            self.controller.save_last_used()
        except OSError as error:
            self.log(f"the last-used config was not saved: {error}")
        if self.controller.running:
            self.controller.stop()
            deadline = time.monotonic() + 30
            while self.controller.running and time.monotonic() < deadline:
                self.update()
                time.sleep(0.05)
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.terminate()
        self.destroy()
