"""The window's remote run (a mixin of CtkTrainView, kept apart to keep the window's file short): the "Run on a
remote machine" button beside Start, the `remote` settings section on the training tab, the host-key dialog, and
the offer to follow again a remote run that was still going when the window last closed. The work is
RemoteController's (modules/ui/RemoteController.py); this file only lays out and shows."""
from __future__ import annotations

import customtkinter as ctk

from modules.ui.ctk_components import button, render_section


class CtkRemoteRun:
    """Mixed into CtkTrainView: uses its config_state, fields, log and show_dialog."""

    def _build_remote_button(self, parent, row: int) -> None:
        from modules.ui.RemoteController import RemoteController
        self.remote = RemoteController(self.config_state)
        self.remote_button = button(parent, "Run on a remote machine", self.start_remote, width=170)
        self.remote_button.grid(row=row, column=1, padx=(6, 0), pady=3)

    def build_remote_section(self, parent, row: int) -> None:
        box = ctk.CTkFrame(parent, fg_color="transparent")
        box.grid(row=row, column=0, columnspan=3, sticky="w", pady=(12, 0))
        row = render_section(box, self.config_state, "remote", fields=self.fields,
                             title="remote machine (Run on a remote machine; docs/remote.md)", width=240,
                             error_width=160)
        # a mapping has no field of its own here: it is named, so the setting is found
        ctk.CTkLabel(box, text="model files the remote has already: remote.model_paths in the config file",
                     anchor="w").grid(row=row, column=0, columnspan=3, sticky="w", padx=8, pady=(2, 0))

    def start_remote(self, accept: str | None = None) -> None:
        if self.remote.running:
            self.remote.stop()
            self.log("remote: stop sent; the run writes a backup and stops, then its files come home")
            return
        problems = self.remote.start(accept)
        if problems:
            self._remote_refused(problems)
            return
        self.remote_button.configure(text="Stop the remote run")
        self.log("remote: checking the config, then connecting")

    def _remote_refused(self, problems: list[str]) -> None:
        self.remote_button.configure(text="Run on a remote machine")
        self.log("Run on a remote machine refused:\n" + "\n".join(f"  - {p}" for p in problems), "ERROR")
        self.show_dialog("Run on a remote machine", "\n\n".join(problems))

    def _ask_host_key(self, host: str, fingerprint: str) -> None:
        dialog = self.show_dialog(
            "Unknown host", f"{host} is not a known host. Its key has the fingerprint\n\n  {fingerprint}\n\nCompare it "
            f"with the one your provider shows (or `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the "
            f"machine). Accept it only if they are equal; it is then remembered.", ok_text="Cancel")

        def accept():
            dialog.destroy()
            self.start_remote(fingerprint)

        button(dialog, f"Accept {fingerprint[:20]}…", accept, width=200).pack(pady=(0, 10))

    def _offer_reattach(self) -> None:
        record = self.remote.reattachable()
        if record is None:
            return
        dialog = self.show_dialog("Remote run", f"Run {record.run_name} on {record.host} was being followed when "
                                                f"the window closed; it may have gone on there.", ok_text="Not now")

        def follow():
            dialog.destroy()
            self.remote.reattach(record)
            self.remote_button.configure(text="Stop the remote run")
            self.log(f"remote: following {record.run_name} on {record.host} again")

        button(dialog, "Follow it and bring its files home", follow, width=240).pack(pady=(0, 10))

    def _poll_remote(self) -> None:
        while not self.remote.events.empty():
            kind, *payload = self.remote.events.get_nowait()
            if kind == "log":
                self.log(payload[0])
            elif kind == "run":
                self.gallery_view.follow(payload[0])   # listed and shown now, its previews as they come home
            elif kind == "connection":
                self.remote_button.configure(text="Stop the remote run" if payload[0] == "reconnected"
                                             else "Stop the remote run (reconnecting...)")
            elif kind == "detached":
                self.remote_button.configure(text="Run on a remote machine")
                self.log(f"remote: {payload[0]} is no longer followed here; it goes on there")
            elif kind == "host_key":
                self.remote_button.configure(text="Run on a remote machine")
                self._ask_host_key(*payload)
            elif kind == "refused":
                self._remote_refused(payload[0])
            elif kind in ("ended", "failed"):
                self.remote_button.configure(text="Run on a remote machine")
                text = (f"remote: the run ended there (exit {payload[0]}); its files are home"
                        if kind == "ended" else f"remote: {payload[0]}")
                self.log(text, "ERROR" if kind == "failed" or payload[0] not in (0, 130) else None)
                self.gallery_view.refresh()
                self.loss_view.refresh_runs()
