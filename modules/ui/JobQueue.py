"""The training job queue: complete config files that run one after another. Imports no toolkit.

The queue is one JSON file (default `workspace/queue/queue.json`); each job keeps a copy of its config next to it
(`jobs/<id>.json`, a complete config as a run writes to run-configs/), so a job is a snapshot: editing the window's
config after "Add to queue" does not change the job. The file is rewritten atomically after every change, so the
queue survives a restart of the app (a job that was running when the app died is "interrupted" and runs again).

`run(train_one)` takes the first waiting job, marks it running, calls `train_one(config_path, job)` and marks the job
done with its outputs or failed with its error; then the next one. A failed job never stops the queue. The runner
(`train_config_file` here, the GUI's worker there) frees the model between jobs (GenericTrainer is dropped and the
garbage collected before the next one loads). One runner at a time: `run` holds the queue's runner lock
(`queue.runner.lock`, naming its holder's host and pid) and a second runner is refused with QueueBusy.

A job's config is checked when it is added, as Start checks (`check_job_config`: paths, model, data, E2V), and
again when it runs (a file deleted meanwhile fails the job, with the whole message).
"""
from __future__ import annotations

import gc
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modules.util.atomic import atomic_write_text
from modules.util.process_lock import LockHeld, ProcessLock

DEFAULT_QUEUE = Path("workspace") / "queue" / "queue.json"
STATES = ("waiting", "paused", "running", "done", "failed", "stopped", "interrupted")
RUNNABLE = ("waiting", "interrupted")


@dataclass
class Job:
    id: str
    name: str
    config: str                      # the job's own copy of the config, a complete config file
    state: str = "waiting"
    error: str = ""
    outputs: list[str] = field(default_factory=list)
    step: int = 0
    total_steps: int = 0
    eta_seconds: float | None = None
    added: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    runner: str = ""                 # "host:pid" of the process running it (the window or `queue run`)

    @property
    def progress(self) -> float:
        return self.step / self.total_steps if self.total_steps else 0.0


class QueueBusy(RuntimeError):
    """Another runner (the window or `queue run`) is running this queue."""


class RunnerLock:
    """The queue's runner lock on `<queue>.runner.lock` (modules/util/process_lock.py: dropped by the kernel when
    its holder dies), naming its holder for the runner that is refused."""

    def __init__(self, queue_path: Path):
        self.queue_path = queue_path
        self.path = queue_path.with_suffix(".runner.lock")
        self._lock = ProcessLock(self.path)

    def acquire(self) -> "RunnerLock":
        try:
            self._lock.acquire()
        except LockHeld as held:
            holder = held.holder
            who = f"{holder.get('host', '?')}:{holder['pid']}" if holder.get("pid") else "another process"
            raise QueueBusy(f"the queue {self.queue_path} is already being run by "
                            f"{who} (host:pid): one runner at a time, or two would train at once. Wait for it, "
                            f"or stop it") from None
        return self

    def release(self) -> None:
        self._lock.release()


def check_job_config(config: dict) -> list[str]:
    """What Start checks before a run, for a job's config dict (a deep copy is checked: nothing is changed): the
    schema, then prepare_config's paths, model, data and E2V checks. The problems, or [] when it would start."""
    import copy

    from modules.util.config.config_io import ConfigError, config_from_dict
    from modules.trainer.prepare import prepare_config
    refused = [MULTI_GPU_REFUSED] if config.get("multi_gpu") else []
    try:
        prepare_config(config_from_dict(copy.deepcopy(config), "the job's config"))
    except ConfigError as error:
        return refused + (list(error.problems) or [str(error)])
    return refused


# a job runs inside the queue's process (the window's worker thread or `queue run`): one process, no ranks
MULTI_GPU_REFUSED = ("multi_gpu: a queued job trains in one process, so its ranks cannot be launched; press Start "
                     "for this config (the window launches the ranks) or run `./run-cmd.sh train --config-path "
                     "FILE`, or turn multi_gpu off to queue it on one GPU")


class JobQueue:
    def __init__(self, path: str | Path = DEFAULT_QUEUE):
        self.path = Path(path)
        self.jobs: list[Job] = []
        self.load()

    @property
    def jobs_dir(self) -> Path:
        return self.path.parent / "jobs"

    # ---- persistence ---------------------------------------------------------------------------------------

    def load(self) -> None:
        if not self.path.is_file():
            self.jobs = []
            return
        data = json.loads(self.path.read_text(encoding="utf-8"))
        known = set(Job.__dataclass_fields__)
        self.jobs = [Job(**{k: v for k, v in item.items() if k in known}) for item in data.get("jobs", [])]
        for job in self.jobs:
            if job.state == "running" and not _runner_alive(job.runner):   # the process that ran it is gone
                job.state = "interrupted"

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps({"jobs": [asdict(job) for job in self.jobs]}, indent=2) + "\n")

    # ---- editing -------------------------------------------------------------------------------------------

    def add(self, config: dict, name: str = "") -> Job:
        """A job from a config dict (a full config: the window's `json_dict()` or a file's content). ValueError when
        a job that has not run yet writes the same output file: the later one would replace it unseen (two jobs
        of one config with a setting changed in between, the usual way to queue variants)."""
        destination = (config.get("output") or {}).get("destination")
        other = self.writing(destination) if destination else None
        if other is not None:
            raise ValueError(f"job {self.jobs.index(other) + 1} ({other.name}, {other.state}) already writes "
                             f"{destination}: the later job would replace it. Give this one another output "
                             f"destination (output.destination, model tab) to keep both")
        job_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        config_path = self.jobs_dir / f"{job_id}.json"
        atomic_write_text(config_path, json.dumps(config, indent=2) + "\n")
        job = Job(id=job_id, name=name or Path(str(config.get("output", {}).get("destination", job_id))).name,
                  config=str(config_path), added=time.time())
        with self._editing():
            self.jobs.append(job)
        return job

    def add_file(self, path: str | Path) -> Job:
        """A job from a config file; refuses (ConfigError, naming the file) one the trainer cannot read or Start
        would refuse (a path that does not exist, a model of another type, ...)."""
        from modules.util.config.config_io import ConfigError, config_to_dict, load_config
        config = config_to_dict(load_config(config_path=str(path)))   # a broken file never waits in the queue
        problems = check_job_config(config)
        if problems:
            raise ConfigError(problems, str(path))
        return self.add(config, name=Path(path).stem)

    def writing(self, destination: str) -> Job | None:
        """The job still to run (or running) whose config writes `destination`, if any."""
        wanted = Path(destination).expanduser().resolve()
        for job in self.jobs:
            if job.state in ("done", "failed", "stopped"):
                continue
            try:
                output = json.loads(Path(job.config).read_text(encoding="utf-8")).get("output") or {}
            except (OSError, ValueError):
                continue
            if output.get("destination") and Path(output["destination"]).expanduser().resolve() == wanted:
                return job
        return None

    def index_of(self, number: int) -> int:
        """A job by its 1-based number as `list` prints it; IndexError names the range."""
        if not 1 <= number <= len(self.jobs):
            raise IndexError(f"no job {number}: the queue has {len(self.jobs)} job(s)")
        return number - 1

    def remove(self, index: int) -> Job:
        with self._editing():
            job = self.jobs[index]
            if job.state == "running":
                raise ValueError(f"job {index + 1} ({job.name}) is running: stop it first")
            del self.jobs[index]
        Path(job.config).unlink(missing_ok=True)
        return job

    def move(self, index: int, offset: int) -> int:
        """Moves a job up (offset -1) or down (+1); returns its new index."""
        with self._editing():
            new = max(0, min(len(self.jobs) - 1, index + offset))
            self.jobs.insert(new, self.jobs.pop(index))
        return new

    def pause(self, index: int) -> None:
        """A waiting job is paused (skipped by run) and a paused one waits again."""
        with self._editing():
            job = self.jobs[index]
            if job.state in RUNNABLE:
                job.state = "paused"
            elif job.state == "paused":
                job.state = "waiting"
            else:
                raise ValueError(f"job {index + 1} is {job.state}: only waiting or paused jobs can be paused or "
                                 f"resumed")

    def retry(self, index: int) -> None:
        with self._editing():
            if self.jobs[index].state in ("failed", "stopped", "done"):
                self.jobs[index].state, self.jobs[index].error = "waiting", ""

    def next_job(self) -> Job | None:
        return next((job for job in self.jobs if job.state in RUNNABLE), None)

    def update_progress(self, job: Job, step: int, total_steps: int, eta_seconds: float | None) -> None:
        """From the training worker: kept in memory (saved with the job's end, not every step)."""
        job.step, job.total_steps, job.eta_seconds = step, total_steps, eta_seconds

    # ---- running -------------------------------------------------------------------------------------------

    def runner_lock(self) -> RunnerLock:
        return RunnerLock(self.path)

    def run(self, train_one: Callable[[str, Job], tuple[list[str], bool]],
            should_stop: Callable[[], bool] = lambda: False, lock: RunnerLock | None = None) -> list[Job]:
        """Runs every waiting job in order; returns the jobs it ran. `train_one(config_path, job)` returns
        (files written, stopped); it raises for a failed run. Paused jobs are skipped; jobs added meanwhile run too
        (the file is read again between jobs). Holds the runner lock (`lock`, taken already, or taken here: QueueBusy
        when another runner has it) until it returns."""
        lock = lock or self.runner_lock().acquire()
        try:
            return self._run(train_one, should_stop)
        finally:
            lock.release()

    def _run(self, train_one, should_stop) -> list[Job]:
        ran = []
        while not should_stop():
            job = self._claim_next()
            if job is None:
                break
            try:
                outputs, stopped = train_one(job.config, job)
            except Exception as error:  # noqa: BLE001  a failed job is marked with its error; the queue goes on
                self._finish(job, "failed", error=str(error).strip() or type(error).__name__)
            else:
                self._finish(job, "stopped" if stopped else "done", outputs=[str(p) for p in outputs])
            ran.append(job)
            gc.collect()  # one model in memory at a time: the last job's is freed before the next loads
            if job.state == "stopped":
                break
        return ran

    @contextmanager
    def _locked(self):
        """Holds the queue's lock file: the window and `run-cmd.sh queue run` may both run this queue, and a job
        read-and-marked by one must never be taken by the other (no lock where fcntl is missing: Windows)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as handle:
            try:
                import fcntl
            except ImportError:
                yield
                return
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @contextmanager
    def _editing(self):
        """An edit of the file as it is now (read again under the lock, written at the end; nothing written when the
        edit raises): a runner's changes made meanwhile are never overwritten by an older view of the queue."""
        with self._locked():
            self.load()
            yield
            self.save()

    def _claim_next(self) -> Job | None:
        """The first waiting job, marked running in the file under the lock; None when no job waits."""
        with self._locked():
            self.load()
            job = self.next_job()
            if job is not None:
                job.state, job.started, job.error = "running", time.time(), ""
                job.runner = f"{socket.gethostname()}:{os.getpid()}"
                self.save()
            return job

    def _finish(self, job: Job, state: str, error: str = "", outputs: list[str] | None = None) -> None:
        with self._locked():
            self._finish_locked(job, state, error, outputs)

    def _finish_locked(self, job: Job, state: str, error: str, outputs: list[str] | None) -> None:
        saved_progress = (job.step, job.total_steps)
        self.load()   # another process (the CLI) may have edited the queue meanwhile
        current = next((j for j in self.jobs if j.id == job.id), None)
        if current is None:       # removed while it ran: nothing to mark
            return
        current.state, current.error, current.ended = state, error, time.time()
        current.outputs = outputs or []
        current.step, current.total_steps = saved_progress
        current.eta_seconds = None
        job.state, job.error, job.outputs = state, error, current.outputs
        self.save()


def _runner_alive(runner: str) -> bool:
    """Whether the process that marked a job running still runs. One on another machine (a shared folder) counts as
    alive: a job is never run twice; one with no runner recorded (an older queue file) as gone."""
    host, _, pid = runner.rpartition(":")
    if not host or not pid.isdigit():
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


def train_config_file(config_path: str, job: Job | None = None,
                      on_update: Callable[[dict], None] | None = None, trainer_holder: list | None = None):
    """Trains one complete config file as `train.py --config-path` does; returns (files written, stopped).
    ConfigError / TrainingError propagate (the queue marks the job failed with the message)."""
    from modules.trainer.GenericTrainer import GenericTrainer
    from modules.trainer.prepare import prepare_config
    from modules.util.config.config_io import load_config
    from modules.util.config.config_io import ConfigError
    config = load_config(config_path=config_path)
    if config.multi_gpu:   # a job queued before multi_gpu jobs were refused, or a file edited since
        raise ConfigError([MULTI_GPU_REFUSED], config_path)
    datasets = prepare_config(config)
    trainer = GenericTrainer(config, on_update=on_update, e2v_datasets=datasets)
    if trainer_holder is not None:
        trainer_holder.append(trainer)
    try:
        written = trainer.train()
        return [str(p) for p in written], trainer.stop_requested.is_set()
    finally:
        if trainer_holder is not None:
            trainer_holder.remove(trainer)
        del trainer
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def describe(queue: JobQueue) -> str:
    """`queue list`: one line per job, numbered from 1."""
    if not queue.jobs:
        return f"the queue {queue.path} is empty"
    lines = [f"queue {queue.path}:"]
    for number, job in enumerate(queue.jobs, 1):
        progress = f" {job.step}/{job.total_steps}" if job.total_steps else ""
        # the whole error: "invalid configuration:" alone says nothing, its problem lines say what to fix
        detail = (": " + job.error.replace("\n", "\n      ")) if job.error else \
            (f" -> {', '.join(job.outputs)}" if job.outputs else "")
        lines.append(f"  {number}. [{job.state}{progress}] {job.name}  ({job.config}){detail}")
    return "\n".join(lines)
