"""The main window across sessions (a part of CtkTrainView, kept apart to keep the window's file short): closing
asks during a run, the interrupted run is offered for resuming on the next start, and the window's settings and the
last-used config are saved on close."""
from __future__ import annotations

import time
from pathlib import Path

from modules.ui.ctk_components import button


class CtkWindowSession:
    """Mixed into CtkTrainView: uses its controller, prefs, dialogs and load_file / start."""

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
        """The running run's config (one process or a multi-GPU launch), offered for resuming on the next start."""
        path = self.controller.resumable_config()
        if path:
            self.prefs.interrupted_config = path

    def _offer_resume(self) -> None:
        path = Path(self.prefs.interrupted_config)
        self.prefs.interrupted_config = ""
        self._save_prefs()
        if not path.is_file():
            return
        dialog = self.show_dialog("Resume?", f"The last session closed during a run ({path.stem}). Resume the "
                                             f"interrupted run from its newest backup?", ok_text="Not now")
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
            self.log(f"the window's settings were not saved: {error}", "WARNING")

    def close(self) -> None:
        try:
            self.controller.save_last_used()
        except OSError as error:
            self.log(f"the last-used config was not saved: {error}", "WARNING")
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
        self.tools_view.controller.stop()   # a tool's child process must not outlive the window
        if not self.training_view.memory.close():   # a planner still tracing: torch aborts the exit without this
            self.log("the memory planner did not stop in time", "WARNING")
        self.destroy()
