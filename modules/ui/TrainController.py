"""The main window's state and actions: presets, the last-used config, model detection, validation, and the
training run in a worker thread. Imports no toolkit.

Threading contract: `start()` runs prepare_config and GenericTrainer.train() in a worker thread. The worker never
touches a widget: it puts events on a queue, and the view drains `poll_events()` from the Tk main loop (`after`).
Stop / sample now / backup now / save now are requests the trainer serves at its next safe point (between
optimizer steps).

Events, as (kind, payload): ("status", str), ("progress", dict from GenericTrainer.on_update plus "epochs",
"epoch_fraction"), ("run_plan", str): the run plan the terminal prints, whole, ("validation", {"validation_loss",
"step", "validation_per_sigma"}: a validation loss, see
docs/validation.md), ("log", str), ("refused", [problems]), ("failed", message), ("finished", {"written": [paths],
"stopped": bool, "backups": [paths]}), ("released", None): the run's trainer is let go (collected on the main thread
when the event is drained).
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from modules.ui.QueueControl import QueueControl
from modules.ui.RankLaunch import RankLaunchControl
from modules.ui.UIState import UIState
from modules.util.config.config_io import ConfigError, read_json_object

ROOT = Path(__file__).resolve().parents[2]
PRESETS_DIR = ROOT / "training_presets"
LAST_USED = ROOT / "workspace" / "ui" / "last-used.json"


@dataclass
class RunState:
    running: bool = False
    status: str = "idle"
    losses: list[float] = field(default_factory=list)
    step: int = 0
    total_steps: int = 0
    epoch: int = 0
    epochs: int = 0
    epoch_fraction: float = 0.0
    step_times: list[float] = field(default_factory=list)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)   # (step, validation loss)
    started: float = 0.0
    resumed_from: int | None = None  # the backup's step when the run continued one
    encode_calls: dict[str, int] = field(default_factory=dict)   # per cache encoder, of the ended run
    plan_text: str = ""              # the run plan the terminal prints at the start (GenericTrainer's start report)

    @property
    def seconds_per_step(self) -> float | None:
        recent = self.step_times[-20:]
        return sum(recent) / len(recent) if recent else None

    @property
    def eta_seconds(self) -> float | None:
        per_step = self.seconds_per_step
        if per_step is None or not self.total_steps:
            return None
        return per_step * max(0, self.total_steps - self.step)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class _QueueLogHandler(logging.Handler):
    def __init__(self, events: queue.Queue):
        super().__init__(logging.INFO)
        self.events = events
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.events.put(("log", self.format(record)))


def _warm_video_codecs() -> None:
    """The first encode / probe / decode of a process initialises FFmpeg's codecs while holding the interpreter:
    done once here on a 2-frame clip, not in the worker's first probe or preview."""
    import tempfile

    import numpy as np

    from modules.util.video_io import probe_media, read_media
    from modules.util.video_frames import write_video

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "warm.mp4"
        write_video(path, np.zeros((2, 16, 16, 3), dtype=np.uint8), 16)
        probe_media(path)
        read_media(path)


class TrainController(QueueControl, RankLaunchControl):
    def __init__(self, state: UIState | None = None, presets_dir: Path = PRESETS_DIR, last_used: Path = LAST_USED,
                 queue_path: Path | None = None):
        from modules.ui.JobQueue import DEFAULT_QUEUE
        self.state = state or UIState()
        self.presets_dir = Path(presets_dir)
        self.last_used = Path(last_used)
        # one queue for every config, the file `run-cmd.sh queue` uses by default: jobs added here run from there
        self.queue_path = Path(queue_path) if queue_path is not None else DEFAULT_QUEUE
        self.current_path: Path | None = None
        self.events: queue.Queue = queue.Queue()
        self.run = RunState()
        self.trainer = None
        self._thread: threading.Thread | None = None
        self._plan_sent = False
        self.last_run_name: str | None = None   # the loss tab reads this run's TensorBoard events after it ended
        self._trainer_holder: list = []
        self._queue_stop = False
        self.current_job = None

    # ---- presets and files -----------------------------------------------------------------------------------

    def preset_tree(self) -> dict[str, list[Path]]:
        """Folder (relative to training_presets/, "" for the top) -> its JSON presets, sorted by name."""
        tree: dict[str, list[Path]] = {}
        for path in sorted(self.presets_dir.rglob("*.json")):
            folder = path.parent.relative_to(self.presets_dir).as_posix()
            folder = "" if folder == "." else folder
            tree.setdefault(folder, []).append(path)
        return tree

    def load(self, path: str | Path) -> None:
        """Loads a preset or a saved config (sparse or full). ConfigError when the file cannot be read."""
        path = Path(path)
        self.state.load(read_json_object(path), str(path))
        self.current_path = path

    def save_as(self, path: str | Path) -> None:
        path = Path(path)
        self.state.save(path)
        self.current_path = path

    def restore_last_used(self) -> bool:
        """On open: the config of the last session, when there is one and it reads."""
        if not self.last_used.is_file():
            return False
        try:
            self.state.load(read_json_object(self.last_used), str(self.last_used))
        except ConfigError as error:
            self.events.put(("log", f"the last-used config {self.last_used} was not restored: {error}"))
            return False
        return True

    def save_last_used(self) -> None:
        """On close: the config as it stands, valid or not."""
        self.state.save(self.last_used)

    # ---- model detection --------------------------------------------------------------------------------------

    def detect_variant(self) -> str:
        """The variant of the chosen base model, read from its configs (no weights are loaded); or why not."""
        from modules.util.wan_detection import NotAWanModelError, detect_variant_from_folder

        base = self.state.get("model.base_model_name") or ""
        if not base:
            return "no base model chosen"
        if not Path(base).is_dir():
            if self.state.get("demo_assets"):
                return "created on first Start (demo)"
            return "a hub id (downloaded at Start)" if self.state.get("model.allow_download") else "not a folder"
        from modules.ui.model_parts import detect_variant_text
        from_files = detect_variant_text(self.state)
        if from_files is not None:
            return from_files
        try:
            variant = detect_variant_from_folder(base)
        except (NotAWanModelError, ValueError, OSError) as error:
            return f"not a Wan model: {error}"
        from modules.ui.variant_text import variant_name
        return variant_name(variant)

    def follow_model_type(self) -> str:
        """Sets `model_type` to the chosen model's (Wan 2.1 / 2.2: the model says which, and Start refuses a
        mismatch); the line saying so, or "" when it already fits or no model can be told."""
        from modules.ui.model_parts import detected_variant
        from modules.ui.variant_text import model_type_note
        variant = detected_variant(self.state)
        note = model_type_note(self.state.get("model_type"), variant)
        if note:
            self.state.set("model_type", variant.model_type.value)
        return note

    # ---- training ----------------------------------------------------------------------------------------------

    @staticmethod
    def preload() -> None:
        """Imports what a run imports, on the calling (main) thread, once. Importing a big library in the worker
        holds the interpreter for up to a second at a time (module initialisation), which would freeze the window
        while a run starts; paid here, it happens once before the window is used."""
        import modules.modelLoader.WanModelLoader  # noqa: F401  (registers; imports diffusers and transformers)
        import modules.modelSampler.TrainingSampler  # noqa: F401
        import modules.modelSetup.WanEmbeddingSetup  # noqa: F401
        import modules.modelSetup.WanFineTuneSetup  # noqa: F401
        import modules.modelSetup.WanLoRASetup  # noqa: F401
        import modules.trainer.GenericTrainer  # noqa: F401
        import modules.trainer.TrainingHooks  # noqa: F401
        import modules.dataLoader.WanBaseDataLoader  # noqa: F401
        import peft  # noqa: F401
        from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel  # noqa
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        from transformers import CLIPVisionModel, UMT5EncoderModel  # noqa: F401
        _warm_video_codecs()
        # The libraries above are hundreds of thousands of long-lived objects. A full garbage collection walks all of
        # them while holding the GIL (hundreds of ms, measured as Tk timer stalls during model loading); frozen,
        # they are left out of every later collection.
        gc.collect()
        gc.freeze()
        try:  # transformers builds its checkpoint key-renaming table (many regexes) on the first from_pretrained
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
            get_checkpoint_conversion_mapping("umt5")
        except ImportError:
            pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> list[str]:
        """Starts training in a worker thread; returns the problems that refuse it (empty when it started). The
        schema problems refuse at once; prepare_config's (paths, model type, E2V, samples file) come back as a
        "refused" event before any model loads, the same ConfigError path as scripts/train.py."""
        if self.running:
            return ["training is already running"]
        problems = self.state.validate()
        if problems:
            return problems
        config = self.state.config()
        from modules.ui.RankLaunch import launch_problems, launches_ranks, process_count, visible_gpus
        gpus = visible_gpus()
        problems = launch_problems(config, gpus)
        if problems:
            self.state.add_problems(problems)   # marked at their fields, as Start's other checks are
            return problems
        # the epochs are the run plan's (it may train fewer than config.epochs): none shown until it comes
        self.run = RunState(running=True, status="preparing", started=time.monotonic())
        self._plan_sent = False
        self.trainer = None   # the last run's: its plan and Stop must not stand for this one
        if launches_ranks(config, gpus):   # each rank a process of its own: train.py launches them
            self.run.status = "launching the ranks"
            return self.start_ranks(self.state.json_dict(), process_count(config, gpus))
        self._thread = threading.Thread(target=self._work, args=(config,), name="training", daemon=True)
        self._thread.start()
        return []

    @staticmethod
    def _new_run_state(**values) -> RunState:
        return RunState(running=True, **values)

    def _attach_log(self):
        handler = _QueueLogHandler(self.events)
        root = logging.getLogger()
        handler.previous_level = root.level
        root.addHandler(handler)
        root.setLevel(min(root.level, logging.INFO) if root.level else logging.INFO)
        return handler

    @staticmethod
    def _detach_log(handler) -> None:
        root = logging.getLogger()
        root.removeHandler(handler)
        root.setLevel(handler.previous_level)

    def _work(self, config) -> None:
        from modules.trainer.GenericTrainer import GenericTrainer, TrainingError
        from modules.trainer.prepare import prepare_config

        handler = _QueueLogHandler(self.events)
        root = logging.getLogger()
        root.addHandler(handler)
        previous_level = root.level
        root.setLevel(min(previous_level, logging.INFO) if previous_level else logging.INFO)
        put = self.events.put
        try:
            put(("status", "checking the config"))
            try:
                datasets = prepare_config(config)
            except ConfigError as error:
                put(("refused", list(error.problems)))
                return
            put(("status", "loading the model and caching"))
            self.trainer = GenericTrainer(config, on_update=self._on_update, e2v_datasets=datasets)
            written = self.trainer.train()
            from modules.trainer.backup_io import list_backups
            stopped = self.trainer.stop_requested.is_set()
            put(("finished", {"written": [str(p) for p in written], "stopped": stopped,
                              "backups": [str(p) for p in list_backups(self.trainer.backup_root)],
                              "report": self._end_report(written) if not stopped else "",
                              "output_dir": str(Path(config.output.destination).parent),
                              "workspace": str(config.workspace_dir)}))
        except ConfigError as error:   # found as the run starts: its workspace held by another job, no run to resume
            put(("refused", list(error.problems)))
        except TrainingError as error:
            put(("failed", str(error)))
        except Exception as error:  # the window must survive any failure and a new run must be able to start
            put(("log", traceback.format_exc()))
            put(("failed", f"{type(error).__name__}: {error}"))
        finally:
            root.removeHandler(handler)
            root.setLevel(previous_level)
            self._release_trainer()

    def _release_trainer(self) -> None:
        """An ended run's model and optimizer are let go: the window may stay open for hours, and the tools tab
        samples the new LoRA in a child process that needs the card's memory. The collection itself runs on the
        main thread ("released"): one here could finalise Tk objects off their thread."""
        trainer, self.trainer = self.trainer, None
        if trainer is not None and getattr(trainer, "data", None) is not None:
            self.run.encode_calls = {name: getattr(encoder, "encode_calls", 0)
                                     for name, encoder in trainer.data.encoders.items()}
        del trainer
        self.events.put(("released", None))

    @staticmethod
    def _collect() -> None:
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    def _end_report(self, written) -> str:
        """The terminal's end report (written files, next commands), for the window's end-of-run panel."""
        from modules.trainer.run_report import end_report
        trainer = self.trainer
        return end_report(trainer, written, trainer.workspace / "run-configs" / f"{trainer.run_name}.json")

    def _on_update(self, info: dict) -> None:
        # called in the worker thread: only queue the numbers
        if "validation_loss" in info:
            self.events.put(("validation", info))
            return
        if "resumed_from" in info:  # the log panel shows it, as the terminal does
            self.events.put(("log", f"resumed run {info['run']} from step {info['resumed_from']} ({info['backup']})"))
            return
        if "note" in info:
            self.events.put(("log", info["note"]))
            return
        if self.trainer is None and self._trainer_holder:
            self.trainer = self._trainer_holder[0]   # a queue job's trainer
        trainer = self.trainer
        plan = getattr(trainer, "plan", None)   # GenericTrainer's run plan (steps, batches per epoch)
        if not self._plan_sent and plan is not None:
            self._plan_sent = True
            # the first update comes after the run's first step: a resumed run's first step follows its backup's
            resumed = info["step"] - 1 if info["step"] > 1 else None
            self.events.put(("plan", {"epochs": plan.epochs, "total_steps": plan.total_steps,
                                      "batches_per_epoch": plan.batches_per_epoch, "resumed_from": resumed,
                                      "run_name": trainer.run_name}))
            if getattr(trainer, "plan_report", ""):   # the run plan the terminal printed, whole
                self.events.put(("run_plan", trainer.plan_report))
        batches = (plan.batches_per_epoch if plan is not None else 0) or 1
        epochs = plan.epochs if plan is not None else trainer.config.epochs
        # the epoch bar shows the run's epochs done (it fills once over the run, it does not refill every epoch)
        done = (trainer.progress.epoch + min(1.0, trainer.progress.epoch_batch / batches)) / max(1, epochs)
        info = dict(info, epochs=epochs, epoch_fraction=min(1.0, done))
        job = self.current_job
        if job is not None:
            run = self.run
            per_step = run.seconds_per_step
            eta = per_step * max(0, info["total_steps"] - info["step"]) if per_step else None
            job.step, job.total_steps, job.eta_seconds = info["step"], info["total_steps"], eta
        self.events.put(("progress", info))

    def stop(self) -> None:
        self._queue_stop = True   # a queue stops after the current job (which stops at its next step)
        if self.stop_ranks():
            return
        trainer = self.trainer or (self._trainer_holder[0] if self._trainer_holder else None)
        if trainer is not None and self.running:
            trainer.request_stop()
            self.events.put(("status", "stopping after this step (a backup is written)"))

    def request(self, action: str) -> str:
        """'sample', 'backup' or 'save' at the trainer's next safe point; returns what the status line says."""
        if self._ranks is not None and self._ranks.poll() is None:
            return f"{action} now: not for a multi-GPU run (its ranks are processes of their own); Stop writes a backup"
        if self.trainer is None or not self.running or not hasattr(self.trainer, "hooks"):
            return f"{action} now: training is not running"
        self.trainer.request(action)
        return f"{action} requested: done after the current step"

    def poll_events(self) -> list[tuple[str, object]]:
        """Drains the queue and updates the run state; called from the Tk main loop."""
        drained = []
        while True:
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                break
            self._apply(kind, payload)
            drained.append((kind, payload))
        return drained

    def _apply(self, kind: str, payload) -> None:
        run = self.run
        if kind == "status":
            run.status = payload
        elif kind == "plan":
            run.epochs, run.total_steps = payload["epochs"], payload["total_steps"]
            run.resumed_from = payload["resumed_from"]
            self.last_run_name = payload["run_name"]
        elif kind == "progress":
            run.status = "training"
            run.step, run.total_steps = payload["step"], payload["total_steps"]
            run.epoch, run.epochs = payload["epoch"], payload["epochs"]
            run.epoch_fraction = payload["epoch_fraction"]
            # every step's loss, read back from the device every few steps (performance.loss_readback_steps)
            run.losses.extend(payload.get("losses", []))
            run.step_times.append(payload["step_time"])
        elif kind == "run_plan":
            run.plan_text = payload
        elif kind == "validation":
            run.validation_losses.append((payload["step"], payload["validation_loss"]))
        elif kind == "refused":
            run.running, run.status = False, "refused: the config has problems"
            self.state.add_problems(payload)
        elif kind == "failed":
            run.running, run.status = False, f"failed: {str(payload).splitlines()[0]}"
        elif kind == "queue_done":
            run.running, run.status = False, payload
        elif kind == "released":
            self._collect()
        elif kind == "finished":
            run.running = False
            run.status = "stopped; backup written" if payload["stopped"] else \
                f"done: {', '.join(payload['written'])}"
            if not payload["stopped"]:   # the plan is done even where max_steps ends it inside its last epoch
                run.epoch_fraction = 1.0

    def wait(self, timeout: float | None = None) -> bool:
        """Tests and shutdown: waits for the worker; True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running
