"""The main window's job queue actions (a part of TrainController, kept apart to keep its file short): "Add to
queue" (the config checked as Start checks it, in a worker thread: it may create the demo's files or read model
headers), Run queue (under the queue's runner lock, so `queue run` in a shell cannot train at the same time) and
the queue's worker. Imports no toolkit.

Events besides TrainController's: ("queued", {"problems": [...], "name": str}) when an add was checked (added when
no problem), ("job", id) when a job starts or ends, ("queue_done", str) when the queue has run.
"""
from __future__ import annotations

import threading
import time
import traceback


class QueueControl:
    """Mixed into TrainController: uses its state, events, run, trainer and log attachment."""

    def job_queue(self):
        """The job queue (workspace/queue/queue.json unless given), read again from its file."""
        from modules.ui.JobQueue import JobQueue
        return JobQueue(self.queue_path)

    def add_to_queue(self) -> list[str]:
        """The config as it stands becomes a job (a snapshot), once checked as Start checks it; returns the schema
        problems that refuse it at once. The rest of the check runs in a worker thread: a "queued" event says
        whether the job was added."""
        problems = self.state.validate()
        if problems:
            return problems
        config = self.state.json_dict()

        def check_and_add():
            from modules.ui.JobQueue import check_job_config
            try:
                problems = check_job_config(config)
                if not problems:
                    job = self.job_queue().add(config)
            except ValueError as error:   # another waiting job writes the same output file
                problems = [str(error)]
            except Exception as error:  # noqa: BLE001  the window must survive any failure of a check
                self.events.put(("log", traceback.format_exc()))
                problems = [f"{type(error).__name__}: {error}"]
            self.events.put(("queued", {"problems": problems, "name": "" if problems else job.name}))

        self._adding = threading.Thread(target=check_and_add, name="queue-add", daemon=True)
        self._adding.start()
        return []

    def wait_added(self, timeout: float | None = None) -> bool:
        """Tests: waits for the check of the last "Add to queue"; True when it has ended."""
        adding = getattr(self, "_adding", None)
        if adding is not None:
            adding.join(timeout)
        return adding is None or not adding.is_alive()

    def start_queue(self) -> list[str]:
        """Runs the queue's waiting jobs one after another in the worker thread (one model at a time), holding the
        queue's runner lock: refused when another runner (`queue run`) holds it."""
        from modules.ui.JobQueue import QueueBusy
        if self.running:
            return ["training is already running"]
        queue = self.job_queue()
        if queue.next_job() is None:
            return [f"the queue {queue.path} has no waiting job"]
        try:
            lock = queue.runner_lock().acquire()
        except QueueBusy as error:
            return [str(error)]
        self.run = self._new_run_state(status="queue: starting")
        self._plan_sent = False
        self.trainer = None   # else the first job's progress read the last run's plan and Stop went to it
        self._queue_stop = False
        self._thread = threading.Thread(target=self._work_queue, args=(queue, lock), name="training", daemon=True)
        self._thread.start()
        return []

    def _work_queue(self, queue, lock) -> None:
        from modules.ui.JobQueue import train_config_file

        def train_one(config_path, job):
            self.run = self._new_run_state(status=f"queue: {job.name}", started=time.monotonic())
            self._plan_sent = False
            self.current_job = job
            self.events.put(("job", job.id))
            holder: list = []
            self._trainer_holder = holder
            try:
                return train_config_file(config_path, job, on_update=self._on_update, trainer_holder=holder)
            except Exception as error:
                # the whole message in the log pane (the queue file and the tab have it too)
                self.events.put(("log", f"ERROR queue: {job.name} failed: {str(error).strip()}"))
                raise
            finally:
                self.trainer = None
                self.events.put(("job", job.id))

        handler = self._attach_log()
        try:
            ran = queue.run(train_one, should_stop=lambda: self._queue_stop, lock=lock)
            failed = sum(job.state == "failed" for job in ran)
            self.events.put(("queue_done", f"queue: {len(ran)} job(s) ran, {failed} failed"))
        except Exception as error:  # the window must survive any failure
            self.events.put(("log", traceback.format_exc()))
            self.events.put(("failed", f"{type(error).__name__}: {error}"))
        finally:
            lock.release()
            self.current_job = None
            self._detach_log(handler)
