"""The training tab's multi-GPU section and the run it starts (docs/multi-gpu.md). Imports no toolkit.

A multi-GPU run cannot train in the window's worker thread: every rank is a process of its own. With `multi_gpu`
on and more than one process, Start writes the config as it stands to `<workspace>/gui-launches/<time>.json` and
runs `scripts/train.py --config-path` on it in a child process, the command the CLI's docs give; train.py then
launches the ranks itself through torchrun's launcher API (`modules/trainer/distributed.relaunch`), exactly as
`./run-cmd.sh train ... multi_gpu=true` does. The window follows the child's output: rank 0's progress bar becomes
the step bar, its other lines go to the log pane, `saved PATH` lines are the files written. Stop sends the launcher
SIGINT, as Ctrl-C in a terminal does: the ranks stop after their step and rank 0 writes a backup.

Events (TrainController's kinds): ("log", str), ("progress", dict), ("finished", dict), ("failed", str).
"""
from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from modules.util.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
# the memory layouts a LoRA's ranks can take; a fine-tune is always sharded (FSDP2)
LAYOUTS = {
    "auto (by the memory plan)": {"distributed.shard_base": "auto", "distributed.cpu_offload": False},
    "DDP (the whole base on every GPU)": {"distributed.shard_base": False, "distributed.cpu_offload": False},
    "sharded base (FSDP2)": {"distributed.shard_base": True, "distributed.cpu_offload": False},
    "sharded base + CPU offload": {"distributed.shard_base": True, "distributed.cpu_offload": True},
}
LAYOUT_FIELDS = ("distributed.shard_base", "distributed.cpu_offload")
# rank 0's tqdm bar: "steps:  40%|####  | 4/10 [00:02<00:03,  2.00step/s, epoch=0, loss=0.1234]"
PROGRESS = re.compile(r"^steps:\s+\d+%\|.*?\|\s*(\d+)/(\d+)\s*\[")
POSTFIX = re.compile(r"(epoch|loss)=(-?\d[0-9.eE+-]*)")
# any other tqdm bar (caching, validation): only its last state is worth a log line
OTHER_BAR = re.compile(r"^[^|]*:\s+\d+%\|")


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def layout_name(state) -> str:
    """The layout menu's entry for the config's distributed.shard_base and cpu_offload."""
    shard, offload = state.get("distributed.shard_base"), bool(state.get("distributed.cpu_offload"))
    for name, values in LAYOUTS.items():
        if values == {"distributed.shard_base": shard, "distributed.cpu_offload": offload}:
            return name
    return next(iter(LAYOUTS))   # auto with cpu_offload: auto shards (the plan decides the rest)


def set_layout(state, name: str) -> None:
    for path, value in LAYOUTS[name].items():
        state.set(path, value)


def process_count(config, gpus: int) -> int:
    """The processes `multi_gpu` launches: distributed.processes, else one per visible GPU."""
    return config.distributed.processes or gpus


def launches_ranks(config, gpus: int) -> bool:
    """Start runs the ranks as processes (not the window's worker thread)."""
    return bool(config.multi_gpu) and process_count(config, gpus) > 1


def on_cuda(config, gpus: int) -> bool:
    return gpus > 0 and (config.device == "auto" or config.device.startswith("cuda"))


def launch_problems(config, gpus: int) -> list[str]:
    """Why the ranks cannot start (before anything is written or loaded), worded with the config's fields."""
    if not config.multi_gpu:
        return []
    count = process_count(config, gpus)
    problems = []
    if count == 0:
        problems.append("multi_gpu: no GPU is visible; set distributed.processes to run several CPU processes, or "
                        "turn multi_gpu off")
    elif on_cuda(config, gpus) and count > gpus:
        problems.append(f"distributed.processes: {count} processes but {gpus} GPU(s) visible: each rank takes one "
                        f"GPU; set it to {gpus} or fewer (0: one per visible GPU)")
    if on_cuda(config, gpus) and re.fullmatch(r"cuda:\d+", config.device) and count > 1:
        problems.append(f"device: {config.device} names one GPU, but each rank takes its own (cuda:LOCAL_RANK); set "
                        f"device to auto or cuda (CUDA_VISIBLE_DEVICES chooses the GPUs)")
    from modules.trainer.distributed import config_problems
    return problems + [p for p in config_problems(config) if not p.startswith("multi_gpu: no GPU")]


def launch_file(workspace_dir: str, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(workspace_dir or "workspace") / "gui-launches" / f"{stamp}.json"


def write_launch_config(data: dict) -> Path:
    """The config on screen (a UIState.json_dict) as the full config train.py reads, under the workspace."""
    import json
    from modules.util.config.config_io import config_from_dict, config_to_dict
    path = launch_file(data.get("workspace_dir", ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(config_to_dict(config_from_dict(data, "the GUI")), indent=4) + "\n")
    return path


def train_command(config_path: str | Path, python: str = sys.executable) -> list[str]:
    """What Start runs: train.py on the saved config (multi_gpu is set in it, so train.py launches the ranks)."""
    return [python, str(ROOT / "scripts" / "train.py"), "--config-path", str(config_path)]


def shell_lines(config_path: str | Path, count: int) -> list[str]:
    """The same run from a terminal: the trainer launching itself, and torchrun's own command."""
    path = shlex.quote(str(config_path))
    return [f"./run-cmd.sh train --config-path {path}",
            f".venv/bin/torchrun --nproc-per-node {count} scripts/train.py --config-path {path}"]


def parse_progress(line: str) -> dict | None:
    """Rank 0's step bar -> {"step", "total_steps", "epoch", "loss"} (None where the bar shows none); None for
    any other line."""
    match = PROGRESS.match(line.strip())
    if match is None:
        return None
    postfix = dict(POSTFIX.findall(line))
    return {"step": int(match[1]), "total_steps": int(match[2]),
            "epoch": int(postfix["epoch"]) if "epoch" in postfix else None,
            "loss": float(postfix["loss"]) if "loss" in postfix else None}


def log_worthy(line: str, previous: str) -> bool:
    """A line for the log pane: not empty, not a repeat, and of another tqdm bar only its finished state."""
    if not line or line == previous:
        return False
    return not OTHER_BAR.match(line) or "100%|" in line


class RankLaunchControl:
    """Mixed into TrainController: a multi-GPU run as a child process, reported through its events queue."""

    _ranks: subprocess.Popen | None = None
    _launch_config: Path | None = None

    def resumable_config(self) -> str:
        """The config to offer for resuming when the window closes during the run: an in-process run's run config
        (run-configs/), a multi-GPU launch's config (gui-launches/: multi_gpu is set in it, so its resume launches
        the ranks again, and rank 0 writes the backups one process would); "" when nothing runs."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and getattr(trainer, "run_name", None):
            return str(trainer.workspace / "run-configs" / f"{trainer.run_name}.json")
        if self._ranks is not None and self._ranks.poll() is None and self._launch_config is not None:
            return str(self._launch_config)
        return ""

    def start_ranks(self, data: dict, count: int) -> list[str]:
        """Writes the config and starts train.py on it; the problems that refuse it (none when it started)."""
        path = self._launch_config = write_launch_config(data)
        command = train_command(path, getattr(self, "python", sys.executable))
        try:
            # the launcher's own process group: Stop's SIGINT goes to the launcher, which passes it to the ranks
            self._ranks = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           bufsize=1, cwd=ROOT, start_new_session=True)
        except OSError as error:
            return [f"cannot start {command[1]}: {error}"]
        for line in [f"multi-GPU: {count} processes; the same run from a terminal:"] + \
                [f"  {line}" for line in shell_lines(path, count)]:
            self.events.put(("log", line))
        self._thread = threading.Thread(target=self._follow_ranks, args=(self._ranks, data), name="ranks",
                                        daemon=True)
        self._thread.start()
        return []

    def _follow_ranks(self, process: subprocess.Popen, data: dict) -> None:
        put = self.events.put
        written, last, logged, report = [], None, "", []
        for line in process.stdout:   # text mode reads tqdm's carriage returns as line ends
            line = line.rstrip()
            progress = parse_progress(line)
            if progress is None:
                if log_worthy(line, logged):
                    put(("log", line))
                    logged = line
                if line.startswith("saved "):
                    written.append(line[len("saved "):])
                if line.startswith("run finished") or report:   # the end report: the end panel shows it
                    report.append(line)
                continue
            now = time.monotonic()
            if last is not None and progress["step"] > last[0]:
                step_time = (now - last[1]) / (progress["step"] - last[0])
                put(("progress", {"step": progress["step"], "total_steps": progress["total_steps"],
                                  "epoch": progress["epoch"] or 0, "epochs": 0, "epoch_fraction": 0.0,
                                  "step_time": step_time,
                                  "losses": [] if progress["loss"] is None else [progress["loss"]]}))
            if last is None or progress["step"] > last[0]:
                last = (progress["step"], now)
        code = process.wait()
        if code in (0, 130):
            put(("finished", {"written": written, "stopped": code == 130, "backups": [],
                              "report": "\n".join(report),
                              "output_dir": str(Path(data.get("output", {}).get("destination", ".")).parent),
                              "workspace": str(data.get("workspace_dir", ""))}))
        else:
            put(("failed", f"the multi-GPU run ended with exit status {code}: its message is in the log pane"))

    def stop_ranks(self) -> bool:
        """Ctrl-C for the ranks' launcher; False when no multi-GPU run is going."""
        process = self._ranks
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signal.SIGINT)
        self.events.put(("status", "stopping after this step (rank 0 writes a backup)"))
        return True


def data_groups(config, count: int) -> tuple[int, str]:
    """(the data-parallel groups a global batch is dealt to, the layout in words when it is not plain DDP)."""
    from modules.trainer import expert_parallel
    if count > 1 and expert_parallel.applies(config, count):
        half = count // 2
        return half, (f"expert parallel: the high-noise expert on ranks 0-{half - 1}, the low-noise expert on ranks "
                      f"{half}-{count - 1}; every step trains both, each on the global batch")
    size = config.distributed.context_parallel
    if count > 1 and size > 1 and count % size == 0:
        return count // size, (f"context parallel: {count // size} group(s) of {size} ranks, each clip's tokens split "
                               f"{size} ways")
    return count, ""


def section_lines(config, gpus: int) -> list[str]:
    """The multi-GPU section's words for `config`: what Start will run, and what stops it."""
    from modules.util.enum.TrainingMethod import TrainingMethod
    if not config.multi_gpu:
        return [f"off: Start trains in one process ({gpus} GPU(s) visible)"]
    count = process_count(config, gpus)
    where = f"{count} GPUs" if on_cuda(config, gpus) else f"{count} CPU processes (gloo)"
    groups, layout = data_groups(config, count)
    lines = [f"{gpus} GPU(s) visible; Start launches {count} ranks on {where}: global batch {config.batch_size} x "
             f"{groups} = {config.batch_size * groups}"] + ([layout] if layout else [])
    if config.training_method is TrainingMethod.FINE_TUNE:
        lines.append("a full fine-tune always shards its weights over the ranks (FSDP2): the layout menu is for "
                     "adapters")
    problems = launch_problems(config, gpus)
    lines += [f"refused: {problem}" for problem in problems]
    if count > 1 and not problems:
        lines += ["the same from a terminal:"] + [f"  {line}" for line in shell_lines(
            launch_file(config.workspace_dir).parent / "<time>.json", count)]
    return lines
