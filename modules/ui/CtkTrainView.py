"""The main window, in OneTrainer's shape: a top bar (presets, load, save as, model type, training method, detected
variant), the tabs, and a bottom bar (status, step and epoch progress, s/step, ETA, live loss curve, Start / Stop)
over a log pane. Every widget is touched from the Tk main loop only: the training worker's events are drained by
`_poll`, scheduled with `after`."""
from __future__ import annotations

import time
from pathlib import Path
from tkinter import filedialog

import customtkinter as ctk

from modules.ui.ConceptController import ConceptController
from modules.ui.ctk_components import BoundField, button, render_section, scrollable_tab
from modules.ui.ElementsController import ElementsController
from modules.ui.SamplingController import SamplingController
from modules.ui.desktop import open_folder
from modules.ui.TrainController import TrainController, format_duration
from modules.ui.ui_prefs import LEVELS, UIPrefs, fit_geometry, shown_at
from modules.util.config.config_io import ConfigError

POLL_MS = 100
TABS = ("general", "model", "concepts", "elements", "training", "LoRA / embedding", "sampling", "gallery", "loss",
        "backup", "tools", "queue")
FIRST_RUN_HINT = ("New here? Pick \"#demo tiny CPU\" in the presets menu (top left) and press Start: it makes a tiny "
                  "model and dataset and trains a LoRA in a few minutes on the CPU.")


class CtkTrainView(ctk.CTk):
    def __init__(self, controller: TrainController | None = None, restore_last_used: bool = True):
        self.controller = controller or TrainController()
        self.prefs_path = self.controller.last_used.parent / "prefs.json"
        self.prefs = UIPrefs.read(self.prefs_path)
        ctk.set_appearance_mode(self.prefs.appearance)
        super().__init__()
        self.title("Wan trainer")
        # the size (and place) it had when it was last closed, on this screen
        self.geometry(fit_geometry(self.prefs.geometry, self.winfo_screenwidth(), self.winfo_screenheight()))
        self.minsize(1000, 700)
        self.log_lines: list[str] = []
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
        self.protocol("WM_DELETE_WINDOW", self.ask_close)
        self._bind_keys()
        self._update_variant()
        self.preloaded = False
        self.after(200, self._preload)
        if self.prefs.interrupted_config:
            self.after(400, self._offer_resume)
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
        self.appearance_menu = ctk.CTkOptionMenu(bar, values=["dark", "light"], width=80,
                                                 command=self.set_appearance)
        self.appearance_menu.set(self.prefs.appearance)
        self.appearance_menu.grid(row=0, column=10, padx=4)
        self.hint_label = ctk.CTkLabel(bar, text=FIRST_RUN_HINT, anchor="w", text_color="#ffb74d", wraplength=1100,
                                       justify="left")
        self.show_hint(not self.prefs.has_run)

    def show_hint(self, shown: bool) -> None:
        """The first-run hint, shown until a run has trained from this window."""
        if shown:
            self.hint_label.grid(row=1, column=0, columnspan=11, sticky="w", padx=8)
        else:
            self.hint_label.grid_remove()

    def set_appearance(self, mode: str) -> None:
        ctk.set_appearance_mode(mode)
        self.prefs.appearance = mode

    def load_preset(self, name: str) -> None:
        self.load_file(self.preset_paths[name])

    def load_file(self, path: str | Path) -> None:
        try:
            self.controller.load(path)
        except ConfigError as error:
            self.show_dialog("Cannot load", str(error))
            return
        shipped = Path(path).resolve().parent == Path(self.controller.presets_dir).resolve()
        self.log(f"loaded preset {Path(path).stem}" if shipped else f"loaded {path}")
        if not self.controller.running:
            self.controller.run.status = "idle"   # a refused Start's status is about the config just replaced
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
        from modules.ui.CtkQueueView import CtkQueueView
        self.queue_view = CtkQueueView(self.tabs["queue"], self)
        from modules.ui.CtkGalleryView import CtkGalleryView
        self.gallery_view = CtkGalleryView(self.tabs["gallery"], self)
        from modules.ui.CtkLossView import CtkLossView
        self.loss_view = CtkLossView(self.tabs["loss"], self)
        self.loss_canvas = self.loss_view.canvas
        self._loss_drawn_at = 0.0

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
        if path == "workspace_dir":
            self.queue_view.refresh()
            self.gallery_view.refresh()
            self.loss_view.refresh_runs()
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
        buttons = ctk.CTkFrame(bar, fg_color="transparent")
        buttons.grid(row=0, column=4, rowspan=3, padx=6)
        self.start_button = button(buttons, "Start", self.start, width=90, fg_color="#2e7d32",
                                   hover_color="#1b5e20")
        self.start_button.grid(row=0, column=0, pady=3)
        self.stop_button = button(buttons, "Stop", self.stop, width=90, fg_color="#b71c1c", hover_color="#7f0000",
                                  state="disabled")
        self.stop_button.grid(row=1, column=0, pady=3)
        self.queue_button = button(buttons, "Add to queue", self.add_to_queue, width=90)
        self.queue_button.grid(row=2, column=0, pady=3)
        folders = ctk.CTkFrame(bar, fg_color="transparent")
        folders.grid(row=0, column=5, rowspan=3, padx=6)
        button(folders, "open output folder", self.open_output_folder, width=130).grid(row=0, column=0, pady=3)
        button(folders, "open workspace", self.open_workspace, width=130).grid(row=1, column=0, pady=3)
        self.level_menu = ctk.CTkOptionMenu(folders, values=list(LEVELS), width=130, command=self.set_log_level)
        self.level_menu.set(self.prefs.log_level)
        self.level_menu.grid(row=2, column=0, pady=3)
        from modules.ui.CtkRunEndPanel import CtkRunEndPanel
        self.end_panel = CtkRunEndPanel(self)   # shown (row 3) at the end of a run
        self.log_box = ctk.CTkTextbox(self, height=90, wrap="word")
        self.log_box.grid(row=4, column=0, sticky="ew", padx=6, pady=(2, 6))
        self.log_box.configure(state="disabled")

    def log(self, text: str) -> None:
        line = text.rstrip("\n")
        self.log_lines.append(line)
        if shown_at(line, self.prefs.log_level):
            self._append_log(line)

    def _append_log(self, line: str) -> None:
        self.log_box.configure(state="normal")
        self.log_box.insert("end", line + "\n")
        self.log_box.see("end")
        self.log_box.configure(state="disabled")

    def set_log_level(self, level: str) -> None:
        """The log panel shows the lines at `level` and above (all lines are kept: a lower level shows them again)."""
        self.prefs.log_level = level
        self.log_box.configure(state="normal")
        self.log_box.delete("1.0", "end")
        self.log_box.configure(state="disabled")
        for line in self.log_lines:
            if shown_at(line, level):
                self._append_log(line)

    def output_folder(self) -> Path:
        return Path(self.config_state.get("output.destination") or "workspace/output").parent

    def open_output_folder(self) -> None:
        problem = open_folder(self.output_folder())
        if problem:
            self.show_dialog("Open folder", problem)

    def open_workspace(self) -> None:
        problem = open_folder(self.config_state.get("workspace_dir") or "workspace")
        if problem:
            self.show_dialog("Open folder", problem)

    def _bind_keys(self) -> None:
        """Ctrl+Enter starts, Ctrl+. stops; Ctrl+A selects a whole entry (Tk's default moves to the line start)."""
        self.bind("<Control-Return>", lambda _e: self.start())
        self.bind("<Control-period>", lambda _e: self.stop())

        def select_all(event):
            event.widget.select_range(0, "end")
            event.widget.icursor("end")
            return "break"

        def select_all_text(event):   # the caption and prompt boxes (tk Text inside CTkTextbox)
            event.widget.tag_add("sel", "1.0", "end-1c")
            event.widget.mark_set("insert", "end-1c")
            return "break"

        self.bind_class("Entry", "<Control-a>", select_all)
        self.bind_class("Entry", "<Control-A>", select_all)
        self.bind_class("Text", "<Control-a>", select_all_text)
        self.bind_class("Text", "<Control-A>", select_all_text)

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
        self._running_started()
        self.log("Start: checking the config")

    def _running_started(self) -> None:
        self._drawn_losses = 0
        self.start_button.configure(state="disabled")
        self.queue_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.end_panel.hide()

    def add_to_queue(self) -> None:
        problems = self.controller.add_to_queue()
        if problems:
            self.show_dialog("Not added to the queue", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in problems))
            return
        self.queue_view.refresh()
        self.log(f"added to the queue ({len(self.controller.job_queue().jobs)} job(s)): see the queue tab")

    def start_queue(self) -> None:
        problems = self.controller.start_queue()
        if problems:
            self.show_dialog("Queue", "\n".join(problems))
            return
        self._running_started()
        self.log("queue: running the waiting jobs")

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
                if not payload["stopped"]:
                    self.end_panel.show(payload, self.controller.run)
            elif kind == "plan":
                self.log(f"training started: {payload['total_steps']} steps over {payload['epochs']} epoch(s) of "
                         f"{payload['batches_per_epoch']} batches")
                if payload["resumed_from"]:
                    self.log(f"resumed from step {payload['resumed_from']}")
                if not self.prefs.has_run:   # a run is made once it trains (a refused Start keeps the hint)
                    self.prefs.has_run = True
                    self.show_hint(False)
                self.sampling_view.reload_samples()   # the demo writes its samples file while it starts
            elif kind == "job":
                self.queue_view.refresh()
            elif kind == "queue_done":
                self._run_ended()
                self.queue_view.refresh()
                self.log(str(payload))
        self._show_progress()
        self.queue_view.show_progress()
        self.sampling_view.poll()
        self.tools_view.poll()
        self.after(POLL_MS, self._poll)

    def _run_ended(self) -> None:
        self.loss_view.refresh_runs()
        self.gallery_view.refresh()
        self.start_button.configure(state="normal")
        self.queue_button.configure(state="normal")
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
        # the loss tab follows the run (its events are read again at most every 2 s)
        if len(run.losses) != self._drawn_losses and time.monotonic() - self._loss_drawn_at > 2:
            self._drawn_losses = len(run.losses)
            self._loss_drawn_at = time.monotonic()
            self.loss_view.reload()

    def ask_close(self, confirm=None) -> None:
        """The window's close button: during training, ask first (`confirm`: tests answer without the modal box);
        the stopped run is offered on the next start."""
        if self.controller.running:
            from tkinter import messagebox
            confirm = confirm or (lambda: messagebox.askyesno(
                "Training is running", "Stop the run (a backup is written) and close? The next start offers to resume "
                "it.", parent=self))
            if not confirm():
                return
            self.remember_interrupted_run()
        self.close()

    def remember_interrupted_run(self) -> None:
        """The running run's config (run-configs/), offered for resuming on the next start."""
        trainer = self.controller.trainer
        if trainer is not None and getattr(trainer, "run_name", None):
            self.prefs.interrupted_config = str(trainer.workspace / "run-configs" / f"{trainer.run_name}.json")

    def _offer_resume(self) -> None:
        path = Path(self.prefs.interrupted_config)
        self.prefs.interrupted_config = ""
        self._save_prefs()
        if not path.is_file():
            return
        dialog = self.show_dialog("Resume?", f"The last session closed during a run ({path.stem}). Resume the "
                                             f"interrupted run from its newest backup?")
        self.resume_button = button(dialog, "Resume the interrupted run",
                                    lambda: (dialog.destroy(), self.resume_run(path)), width=220)
        self.resume_button.pack(pady=(0, 10))

    def resume_run(self, config_path: str | Path) -> None:
        """Loads a run's config with backup.continue_last_backup on and starts it."""
        self.load_file(config_path)
        self.config_state.set_text("backup.continue_last_backup", "true")
        self.start()

    def _save_prefs(self) -> None:
        try:
            self.prefs.write(self.prefs_path)
        except OSError as error:
            self.log(f"the window's settings were not saved: {error}")

    def close(self) -> None:
        try:
            self.controller.save_last_used()
        except OSError as error:
            self.log(f"the last-used config was not saved: {error}")
        self.prefs.geometry = self.geometry()
        self._save_prefs()
        if self.controller.running:
            self.controller.stop()
            deadline = time.monotonic() + 30
            while self.controller.running and time.monotonic() < deadline:
                self.update()
                time.sleep(0.05)
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.terminate()
        self.destroy()
