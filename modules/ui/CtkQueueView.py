"""The queue tab: the jobs of the workspace's queue (modules/ui/JobQueue.py) with their state, progress, ETA and
output or error; move up / down, pause, remove; Run queue. "Add to queue" sits beside Start in the bottom bar."""
from __future__ import annotations

import customtkinter as ctk

from modules.ui.ctk_components import button
from modules.ui.TrainController import format_duration


class CtkQueueView:
    def __init__(self, frame, app):
        self.app = app
        self.frame = frame
        top = ctk.CTkFrame(frame, fg_color="transparent")
        top.grid(row=0, column=0, sticky="w", padx=8, pady=6)
        self.run_button = button(top, "Run queue", self.run_queue, width=110)
        self.run_button.grid(row=0, column=0, padx=4)
        button(top, "Refresh", self.refresh, width=90).grid(row=0, column=1, padx=4)
        self.path_label = ctk.CTkLabel(top, text="", anchor="w")
        self.path_label.grid(row=0, column=2, padx=8, sticky="w")
        self.table = ctk.CTkFrame(frame, fg_color="transparent")
        self.table.grid(row=1, column=0, sticky="nw", padx=8)
        self.rows: list[dict] = []
        self.refresh()

    def queue(self):
        return self.app.controller.job_queue()

    def refresh(self) -> None:
        for child in self.table.winfo_children():
            child.destroy()
        self.rows = []
        queue = self.queue()
        self.path_label.configure(text=f"{queue.path}  ({len(queue.jobs)} job(s); a job is a snapshot of the config "
                                       f"when it was added)")
        for column, title in enumerate(("#", "job", "state", "progress", "ETA", "output / error")):
            ctk.CTkLabel(self.table, text=title, font=ctk.CTkFont(weight="bold"), anchor="w").grid(
                row=0, column=column, sticky="w", padx=4)
        for index, job in enumerate(queue.jobs):
            row = index + 1
            ctk.CTkLabel(self.table, text=str(row), width=24).grid(row=row, column=0, padx=4)
            name = job.name if len(job.name) <= 34 else job.name[:33] + "…"   # the state column stays apart
            ctk.CTkLabel(self.table, text=name, anchor="w", width=250).grid(row=row, column=1, sticky="w", padx=(0, 8))
            state = ctk.CTkLabel(self.table, text=job.state, anchor="w", width=80,
                                 text_color="#e57373" if job.state == "failed" else None)
            state.grid(row=row, column=2, sticky="w")
            bar = ctk.CTkProgressBar(self.table, width=140)
            bar.set(1.0 if job.state == "done" else job.progress)
            bar.grid(row=row, column=3, padx=4)
            eta = ctk.CTkLabel(self.table, text="--", width=70)
            eta.grid(row=row, column=4)
            # the whole error ("invalid configuration:" alone says nothing; its problem lines say what to fix)
            detail = job.error if job.error else ", ".join(job.outputs)
            ctk.CTkLabel(self.table, text=detail, anchor="w", justify="left", width=320, wraplength=320).grid(
                row=row, column=5, sticky="w", padx=4)
            actions = ctk.CTkFrame(self.table, fg_color="transparent")
            actions.grid(row=row, column=6, padx=4)
            buttons = {}
            for col, (text, command) in enumerate((("↑", lambda i=index: self._edit("move", i, -1)),
                                                   ("↓", lambda i=index: self._edit("move", i, 1)),
                                                   ("pause" if job.state != "paused" else "resume",
                                                    lambda i=index: self._edit("pause", i)),
                                                   ("retry", lambda i=index: self._edit("retry", i)),
                                                   ("remove", lambda i=index: self._edit("remove", i)))):
                buttons[text] = button(actions, text, command, width=28 if len(text) == 1 else 60)
                buttons[text].grid(row=0, column=col, padx=1)
            self.rows.append({"id": job.id, "state": state, "bar": bar, "eta": eta, "buttons": buttons,
                              "detail": detail})

    def _edit(self, action: str, index: int, *args) -> None:
        queue = self.queue()
        try:
            getattr(queue, action)(index, *args)
        except (ValueError, IndexError) as error:
            self.app.show_dialog("Queue", str(error))
        self.refresh()

    def run_queue(self) -> None:
        self.app.start_queue()

    def show_progress(self) -> None:
        """The running job's progress, from the worker's in-memory job (the file holds it at the job's end)."""
        job = self.app.controller.current_job
        if job is None:
            return
        for row in self.rows:
            if row["id"] == job.id:
                row["state"].configure(text="running")
                row["bar"].set(job.progress)
                row["eta"].configure(text=format_duration(job.eta_seconds))
