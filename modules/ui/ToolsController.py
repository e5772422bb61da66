"""The tools tab: convert a model, convert or merge a LoRA, sample a model outside training, compare checkpoints x
strengths. Each runs the script the command line runs (scripts/convert_model.py, scripts/sample.py, scripts/compare.py) in a child process with the same arguments, so
the GUI and the CLI cannot drift apart, and a crash in a tool cannot take the window down. Imports no toolkit.

`run()` streams the child's output lines to a queue (drained from the Tk loop) and ends with ("done", exit code,
[the lines it printed on stdout: the files written])."""
from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def convert_model_command(input_name: str, output_format: str, destination: str, base_model: str = "",
                          dtype: str = "") -> list[str]:
    command = ["convert_model", "--input-name", input_name, "--output-model-format", output_format,
               "--output-model-destination", destination]
    if base_model:
        command += ["--base-model-name", base_model]
    if dtype:
        command += ["--output-dtype", dtype]
    return command


def convert_lora_command(lora: str, output_format: str, destination: str, dtype: str = "") -> list[str]:
    command = ["convert_model", "--training-method", "LORA", "--input-name", lora, "--output-model-format",
               output_format, "--output-model-destination", destination]
    return command + (["--output-dtype", dtype] if dtype else [])


def merge_lora_command(base_model: str, loras: list[str], output_format: str, destination: str,
                       dtype: str = "") -> list[str]:
    command = ["convert_model", "--base-model-name", base_model]
    for lora in loras:
        command += ["--merge-lora", lora]
    command += ["--output-model-format", output_format, "--output-model-destination", destination]
    return command + (["--output-dtype", dtype] if dtype else [])


# the sample and compare forms' accelerator menu: the sampling tab's accelerator (sampling.accelerator), or none
ACCELERATOR_CHOICES = ["the sampling tab's", "none"]


def sampling_accelerator(state):
    """The sampling tab's accelerator (`sampling.accelerator` of the UIState), which the sample and compare forms
    run with when asked: None when it names no file; ValueError naming the field when a value is not valid."""
    from pydantic import ValidationError

    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    section = state.get("sampling.accelerator") or {}
    if not section.get("file"):
        return None
    try:
        return AcceleratorConfig(**section)
    except ValidationError as error:
        raise ValueError(f"sampling.accelerator (sampling tab): {error}") from None


def accelerator_arguments(config) -> list[str]:
    """sample.py's / compare.py's options for an AcceleratorConfig: its files, strength and whole schedule."""
    command = ["--accelerator", f"{config.file}:{config.strength:g}"]
    if config.file_2:
        command += ["--accelerator-2", config.file_2]
    return command + ["--accelerator-timesteps", ",".join(str(t) for t in config.timestep_list()),
                      "--accelerator-shift", f"{config.shift:g}"]


def sample_command(base_model: str, prompt: str, output_dir: str, *, loras: list[str] = (), width: int = 0,
                   height: int = 0, frames: int = 0, steps: int = 0, guidance: float | None = None, seed: int = -1,
                   negative_prompt: str = "", image: str = "", elements: dict[str, str] | None = None,
                   e2v_config: str = "", device: str = "auto", conditions: dict[str, str] | None = None,
                   reference_images: list[str] = (), accelerator=None) -> list[str]:
    """`conditions`: a control or character model's inputs by sample.py's option name without the dashes
    (CONDITION_OPTIONS); `reference_images`: VACE's references in order, or Animate's one character;
    `accelerator`: an AcceleratorConfig the sample runs with (its steps, not `steps`)."""
    command = ["sample"] + (["--base-model-name", base_model] if base_model else []) + [
        "--prompt", prompt, "--output-dir", output_dir, "--device", device]  # no base: the one the LoRA records
    for lora in loras:
        command += ["--lora", lora]
    if accelerator is not None:
        command += accelerator_arguments(accelerator)
    for option, value in (("--width", width), ("--height", height), ("--frames", frames),
                          ("--steps", 0 if accelerator is not None else steps)):
        if value:
            command += [option, str(value)]
    if guidance is not None:
        command += ["--guidance", str(guidance)]
    if seed >= 0:
        command += ["--seed", str(seed)]
    if negative_prompt:
        command += ["--negative-prompt", negative_prompt]
    if image:
        command += ["--image", image]
    for name, path in (elements or {}).items():
        command += ["--element", f"{name}={path}"]
    if e2v_config:
        command += ["--e2v-config", e2v_config]
    for reference in reference_images:
        command += ["--reference-image", reference]
    for option in CONDITION_OPTIONS:
        value = (conditions or {}).get(option, "")
        if value:
            command += [f"--{option}", str(value)]
    return command


# scripts/sample.py's options for control and character models (docs/vace.md, docs/animate.md), by model kind;
# --reference-image is given apart (repeatable)
CONDITION_OPTIONS = ("control-video", "mask-video", "control-scale", "pose-video", "face-video", "background-video",
                     "driving-video", "mode", "continuation-frames")
CONDITIONS = {"VACE": ("control-video", "mask-video", "control-scale"),
              "Wan-Fun Control": ("control-video",),   # --image: the start image
              "Wan-Fun Control A14B": ("control-video", "mask-video"),
              "Animate": ("pose-video", "face-video", "background-video", "mask-video", "mode",
                          "continuation-frames"),
              "Animate-2": ("driving-video", "continuation-frames")}


def condition_kind(variant) -> str:
    """The sample form's conditions for a model's variant (a key of CONDITIONS, or 'none'); a mask video only where
    the variant takes one (`takes_control_mask`)."""
    if variant is None:
        return "none"
    if variant.is_fun_control:
        return "Wan-Fun Control A14B" if variant.takes_control_mask else "Wan-Fun Control"
    if variant.takes_driving_video:
        return "Animate-2"
    return "VACE" if variant.is_vace else "Animate" if variant.is_animate else "none"


def driving_video(conditions: dict[str, str]) -> str:
    """The video a result plays beside: the control video (VACE), the pose video (Animate) or the driving video
    (Animate-2); "" for none."""
    return conditions.get("control-video") or conditions.get("pose-video") or conditions.get("driving-video") or ""


def compare_command(base_model: str, loras: list[str], strengths: list[float], output_dir: str, *,
                    samples_file: str = "", prompt: str = "", device: str = "auto", width: int = 0, height: int = 0,
                    frames: int = 0, steps: int = 0, accelerator=None) -> list[str]:
    """scripts/compare.py: every checkpoint (file, folder of saves, backup) x strength, a grid per sample; a size
    given here applies where a sample gives none. `accelerator`: an AcceleratorConfig every cell runs with (its
    steps, not `steps`)."""
    command = ["compare", "--base-model-name", base_model, "--lora", *loras]
    if strengths:
        command += ["--strengths", *(f"{s:g}" for s in strengths)]
    command += ["--samples-file", samples_file] if samples_file else ["--prompt", prompt]
    if accelerator is not None:
        command += accelerator_arguments(accelerator)
        steps = 0
    for option, value in (("--width", width), ("--height", height), ("--frames", frames), ("--steps", steps)):
        if value:
            command += [option, str(value)]
    return command + ["--output-dir", output_dir, "--device", device]


def parse_strengths(text: str) -> list[float]:
    """'0.5, 0.75 1' -> [0.5, 0.75, 1.0]; raises ValueError naming a part that is not a number."""
    parts = [part for part in text.replace(",", " ").split() if part]
    try:
        return [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"strengths: {text!r} is not a list of numbers (e.g. 0.5 0.75 1.0)") from None


class ToolsController:
    def __init__(self, python: str = sys.executable):
        self.python = python
        self.events: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shell_line(self, command: list[str]) -> str:
        """What the user would type: ./run-cmd.sh SCRIPT ARGS."""
        import shlex
        return "./run-cmd.sh " + " ".join(shlex.quote(part) for part in command)

    def run(self, command: list[str]) -> bool:
        """Starts `scripts/<command[0]>.py command[1:]`; False when a tool is already running."""
        if self.running:
            return False
        self._thread = threading.Thread(target=self._work, args=(command,), name="tool", daemon=True)
        self._thread.start()
        return True

    def _work(self, command: list[str]) -> None:
        script = ROOT / "scripts" / f"{command[0]}.py"
        self.events.put(("log", self.shell_line(command)))
        written = []
        try:
            process = subprocess.Popen([self.python, str(script), *command[1:]], cwd=Path.cwd(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        except OSError as error:
            self.events.put(("done", (1, [f"cannot start {script}: {error}"])))
            return
        self._process = process
        for line in process.stdout:
            line = line.rstrip("\n")
            self.events.put(("log", line))
            if line and not line.startswith(" ") and Path(line).exists():
                written.append(line)
        self.events.put(("done", (process.wait(), written)))

    def stop(self) -> bool:
        """Ends the running tool (a comparison at full size runs for hours on a CPU); False when none runs. The
        window calls it when it closes too: the child would otherwise go on writing after the window is gone."""
        process = self._process
        if process is None or process.poll() is not None:
            return False
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        return True

    def poll_events(self) -> list[tuple[str, object]]:
        drained = []
        while True:
            try:
                drained.append(self.events.get_nowait())
            except queue.Empty:
                return drained

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running
