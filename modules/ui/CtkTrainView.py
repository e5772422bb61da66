"""The main window, in OneTrainer's shape: a top bar (presets, load, save as, model type, training method, detected
variant), the tabs, and a bottom bar (status, step and epoch progress, s/step, ETA, live loss curve, Start / Stop)
over a log pane. Every widget is touched from the Tk main loop only: the training worker's events are drained by
`_poll`, scheduled with `after`."""
from __future__ import annotations

from pathlib import Path
from tkinter import filedialog

import gc
import customtkinter as ctk

from modules.ui.ConceptController import ConceptController
from modules.ui.ctk_components import BoundField, button, render_section, scrollable_tab
from modules.ui.CtkBottomBar import CtkBottomBar
from modules.ui.CtkRemoteRun import CtkRemoteRun
from modules.ui.CtkWindowSession import CtkWindowSession
from modules.ui.ElementsController import ElementsController
from modules.ui.SamplingController import SamplingController
from modules.ui.TrainController import TrainController
from modules.ui.ui_prefs import UIPrefs, fit_geometry
from modules.util.config.config_io import ConfigError

POLL_MS = 100
TABS = ("general", "model", "concepts", "elements", "control", "training", "LoRA / embedding", "sampling", "gallery", "loss",
        "backup", "tools", "queue")
FIRST_RUN_HINT = ("New here? Pick \"#demo tiny CPU\" in the presets menu (top left) and press Start: it makes a tiny "
                  "model and dataset and trains a LoRA in a few minutes on the CPU.")


class CtkTrainView(CtkBottomBar, CtkRemoteRun, CtkWindowSession, ctk.CTk):
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
        self.log_lines: list[tuple[str, str]] = []   # (level, line): the pane shows them by its filter
        self.config_state = self.controller.state
        self.concepts = ConceptController(self.config_state)
        self.elements = ElementsController(self.config_state)
        self.sampling = SamplingController(self.config_state)
        self.fields: dict[str, BoundField] = {}
        self.dialogs: list[ctk.CTkToplevel] = []
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
        self.after(600, self._offer_reattach)
        self.after(POLL_MS, self._poll)

    def _preload(self) -> None:
        self.status_label.configure(text="loading the trainer's libraries…")
        self.update_idletasks()
        self.controller.preload()
        # the libraries' millions of long-lived objects (torch, diffusers, transformers) moved out of the collector's
        # reach: otherwise a full collection, which any thread's allocations can start (the loss follower parsing
        # 20,000 events), walks them all while holding the interpreter lock and stalls the window for 100 ms or more
        gc.freeze()
        self.preloaded = True
        self.status_label.configure(text="idle")
        self.training_view.replan_soon()   # the memory line of the config restored at open (later: every edit)

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
        self.hint_label = ctk.CTkLabel(bar, text=FIRST_RUN_HINT, anchor="w", text_color=("#a85a00", "#ffb74d"), wraplength=1100,
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
        from modules.ui.model_parts import detected_variant, intended_variant
        from modules.ui.variant_text import intended_variant_note, variant_description
        followed = self.controller.follow_model_type()
        if followed:
            self.log(followed)
        self.variant_label.configure(text=f"variant: {self.controller.detect_variant()}")
        if hasattr(self, "variant_detail"):
            variant = detected_variant(self.config_state)
            described = variant_description(variant)
            self.variant_detail.configure(text=f"detected {variant.value}: {described}" if described else "")
            note = intended_variant_note(intended_variant(self.config_state), variant)
            self.intended_note.configure(text=note)
            if note:
                self.intended_box.grid()
                self.follow_button.configure(text=f"set intended variant to {variant.value}",
                                             command=lambda: self.fields["model.intended_variant"].set_text(
                                                 variant.value))
            else:
                self.intended_box.grid_remove()

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
        # the detected variant in words: what a VACE / VACE-Fun / Animate model takes and which files give it
        self.variant_detail = ctk.CTkLabel(model, text="", anchor="w", justify="left", wraplength=900)
        self.variant_detail.grid(row=row + 1, column=0, columnspan=3, sticky="w", padx=8)
        # where the config's intended variant is not the chosen model's: why Start refuses, and a way to follow it
        self.intended_box = ctk.CTkFrame(model, fg_color="transparent")
        self.intended_box.grid(row=row + 2, column=0, columnspan=3, sticky="w", padx=4)
        self.intended_note = ctk.CTkLabel(self.intended_box, text="", anchor="w", justify="left", wraplength=760,
                                          text_color=("#a85a00", "#ffb74d"))
        self.intended_note.grid(row=0, column=0, sticky="w", padx=4)
        self.follow_button = button(self.intended_box, "", lambda: None, width=200)
        self.follow_button.grid(row=0, column=1, sticky="w", padx=4)
        row += 3
        for part in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder", "tokenizer"):
            row = render_section(model, self.config_state, f"model.{part}", start_row=row, fields=self.fields,
                                 title=part.replace("_", " "))
            self.part_pickers.append(CtkModelPartPicker(model, self.config_state, part, row))
            row += 1
        render_section(model, self.config_state, "output", start_row=row, fields=self.fields, title="output")

        self.concepts_view = CtkConceptsView(self.tabs["concepts"], self)
        self.elements_view = CtkElementsView(self.tabs["elements"], self)
        from modules.ui.CtkControlView import CtkControlView
        self.control_view = CtkControlView(self.tabs["control"], self)
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
        self.control_view.refresh()
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
        elif path == "model.base_model_name":
            self.sampling_view.follow_model()
        if path == "workspace_dir":
            self.queue_view.refresh()
            self.gallery_view.refresh()
            self.loss_view.refresh_runs()
        self.elements_view.on_config_change(path)
        if path.split(".")[0] in ("data", "model", "animate"):   # what the control tab's preview shows changed
            self.control_view.refresh()
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

    def _bind_keys(self) -> None:
        """Ctrl+Enter starts, Ctrl+. stops; Ctrl+A selects a whole entry (Tk's default moves to the line start)."""
        self.bind("<Control-Return>", lambda _e: self.start())
        self.bind("<Control-period>", lambda _e: self.stop())

        def select_all(event):
            # by Tcl path: the file dialogs' own (ttk) entries have no Python widget object behind them
            self.tk.call(str(event.widget), "selection", "range", 0, "end")
            self.tk.call(str(event.widget), "icursor", "end")
            return "break"

        def select_all_text(event):   # the caption and prompt boxes (tk Text inside CTkTextbox)
            event.widget.tag_add("sel", "1.0", "end-1c")
            event.widget.mark_set("insert", "end-1c")
            return "break"

        for entry_class in ("Entry", "TEntry"):   # TEntry: the Load / Save / folder dialogs' name fields
            self.bind_class(entry_class, "<Control-a>", select_all)
            self.bind_class(entry_class, "<Control-A>", select_all)
        self.bind_class("Text", "<Control-a>", select_all_text)
        self.bind_class("Text", "<Control-A>", select_all_text)

    def show_dialog(self, title: str, text: str, ok_text: str = "OK") -> ctk.CTkToplevel:
        """A message window that does not block the main loop (training and timers go on)."""
        dialog = ctk.CTkToplevel(self)
        dialog.title(title)
        dialog.geometry("+%d+%d" % (self.winfo_rootx() + 120, self.winfo_rooty() + 120))
        box = ctk.CTkTextbox(dialog, width=620, height=220, wrap="word")
        box.insert("end", text)
        box.configure(state="disabled")
        box.pack(padx=10, pady=10, fill="both", expand=True)
        button(dialog, ok_text, dialog.destroy, width=80).pack(pady=(0, 10))
        dialog.transient(self)
        self.dialogs.append(dialog)
        return dialog

    # ---- actions ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        problems = self.controller.start()
        if problems:
            self.log("Start refused:\n" + "\n".join(f"  - {p}" for p in problems), "ERROR")
            self.show_dialog("Start refused", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in problems))
            return
        self._running_started()
        self.log("Start: checking the config")

    def _running_started(self) -> None:
        for bar, label in ((self.step_bar, self.step_label), (self.epoch_bar, self.epoch_label)):
            bar.set(0)   # the last run's numbers are not this one's (its plan comes after loading)
            label.configure(text="0 / 0")
        self.start_button.configure(state="disabled")
        self.queue_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.end_panel.hide()

    def add_to_queue(self) -> None:
        """The config is checked as Start checks it (in the controller's worker); the "queued" event says how."""
        problems = self.controller.add_to_queue()
        if problems:
            self._not_queued(problems)
            return
        self.log("Add to queue: checking the config")

    def _not_queued(self, problems: list[str]) -> None:
        self.log("Not added to the queue:\n" + "\n".join(f"  - {p}" for p in problems), "ERROR")
        self.show_dialog("Not added to the queue", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in problems))

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
                self.log("Start refused:\n" + "\n".join(f"  - {p}" for p in payload), "ERROR")
                self.show_dialog("Start refused", "Fix these first:\n\n" + "\n".join(f"- {p}" for p in payload))
            elif kind == "failed":
                self._run_ended()
                self.log(f"training failed: {payload}", "ERROR")
                self.show_dialog("Training failed", str(payload))
            elif kind == "finished":
                self._run_ended()
                self.log(self.controller.run.status)
                if not payload["stopped"]:
                    self.end_panel.show(payload, self.controller.run)
            elif kind == "run_plan":
                self.log(str(payload))   # whole, as the terminal prints it (the end panel shows it again)
            elif kind == "plan":
                self.log(f"training started: {payload['total_steps']} steps over {payload['epochs']} epoch(s) of "
                         f"{payload['batches_per_epoch']} batches")
                if payload["resumed_from"]:
                    self.log(f"resumed from step {payload['resumed_from']}")
                if not self.prefs.has_run:   # a run is made once it trains (a refused Start keeps the hint)
                    self.prefs.has_run = True
                    self.show_hint(False)
                self.gallery_view.follow(payload["run_name"])   # listed and shown now, previews as they come
                self.sampling_view.reload_samples()   # the demo writes its samples file while it starts
                self._update_variant()                  # and its model (the memory line waits for the run's end)
                for picker in self.part_pickers:
                    picker.refresh()
            elif kind == "queued":
                if payload["problems"]:
                    self._not_queued(payload["problems"])
                else:
                    self.queue_view.refresh()
                    self.log(f"added {payload['name']} to the queue ({len(self.controller.job_queue().jobs)} "
                             f"job(s)): see the queue tab")
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
        self._poll_remote()
        self.after(POLL_MS, self._poll)

    def _run_ended(self) -> None:
        # the demo's first Start makes its model: what the window said about the base model before is stale
        self._update_variant()
        for picker in self.part_pickers:
            picker.refresh()
        self.training_view.replan_soon()
        self.loss_view.refresh_runs()
        self.gallery_view.refresh()
        self.start_button.configure(state="normal")
        self.queue_button.configure(state="normal")
        self.stop_button.configure(state="disabled")
        self.sampling_view.refresh_previews()
