"""The main window's bottom bar and log pane (a part of CtkTrainView, kept apart to keep the window's file short):
status, step and epoch progress with s/step and ETA, Start / Stop / Add to queue, the folder buttons, the log level
filter, the end-of-run panel's place and the log pane. Widgets are touched from the Tk main loop only."""
from __future__ import annotations

from pathlib import Path

import customtkinter as ctk

from modules.ui.ctk_components import button
from modules.ui.desktop import open_folder
from modules.ui.TrainController import format_duration
from modules.ui.ui_prefs import LEVELS, level_shown, line_level


class CtkBottomBar:
    """Mixed into CtkTrainView: uses its controller, prefs, config_state, log_lines and actions."""

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
        self._build_remote_button(buttons, 0)   # beside Start (CtkRemoteRun)
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

    def log(self, text: str, level: str | None = None) -> None:
        """A message in the log pane. Every line of it has the message's level (given, or its first line's), so a
        pane filtered to WARNING or ERROR shows whole messages: a refusal's problems, a failure, a traceback."""
        lines = text.rstrip("\n").split("\n")
        level = level or line_level(lines[0])
        for line in lines:
            self.log_lines.append((level, line))
            if level_shown(level, self.prefs.log_level):
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
        for line_level_, line in self.log_lines:
            if level_shown(line_level_, level):
                self._append_log(line)

    def output_folder(self) -> Path:
        return Path(self.config_state.get("output.destination") or "workspace/output").parent

    def open_output_folder(self) -> None:
        self._open_folder(self.output_folder())

    def open_workspace(self) -> None:
        self._open_folder(self.config_state.get("workspace_dir") or "workspace")

    def _open_folder(self, folder) -> None:
        """The file manager; without one, the folder's absolute path in a dialog, with a button that copies it."""
        problem = open_folder(folder)
        if problem:
            path = str(Path(folder).expanduser().absolute())
            dialog = self.show_dialog("Open folder", problem)

            def copy():
                self.clipboard_clear()
                self.clipboard_append(path)
                self.log(f"copied {path}")

            button(dialog, "copy the path", copy, width=120).pack(pady=(0, 10))

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
