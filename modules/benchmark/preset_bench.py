"""`benchmark.py presets`: every preset in training_presets/ started for a few steps at its own shape, with its own
switches, under the memory its name promises, each in its own process (a memory cap is per process, and each run
must start from an empty device).

From a preset: the architecture (from model.base_model_name), the largest frame bucket at the preset's resolution
in 16:9 (the data loader's own bucket arithmetic), LoRA rank and targets or a full fine-tune, the transformer's
weight dtype (FLOAT_8 -> fp8), gradient checkpointing and the performance section, and the optimizer. The cap: a
"16GB" name runs under 15 GiB, a "24GB" name under 22 GiB (the rest of the card is the CUDA context, the
allocator's slack and the desktop); a name without a size runs uncapped.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "training_presets"
CAPS_GIB = {16: 15.0, 24: 22.0}
ARCHITECTURE_BY_MODEL = (("Wan2.1-T2V-1.3B", "wan2.1-1.3b"), ("Wan2.1-T2V-14B", "wan2.1-14b"),
                         ("Wan2.2-TI2V-5B", "wan2.2-5b"), ("Wan2.2-T2V-A14B", "wan2.2-a14b-expert"))


@dataclass
class PresetRun:
    preset: str
    arguments: list[str] = field(default_factory=list)   # benchmark.py train arguments; empty: not run
    reason: str = ""                                      # why it is not run
    cap_gib: float | None = None

    def command(self) -> str:
        return "python scripts/benchmark.py train " + " ".join(shlex.quote(a) for a in self.arguments)


def preset_run(path: Path, steps: int = 3) -> PresetRun:
    from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
    from modules.util.config.config_io import load_config

    config = load_config(preset_path=str(path))
    name = path.stem
    model = config.model.base_model_name
    variant = next((arch for key, arch in ARCHITECTURE_BY_MODEL if key in model), None)
    if variant is None:
        return PresetRun(name, reason=f"{model or 'a local model'}: no full-size architecture in the benchmark "
                                      f"(the benchmark covers {', '.join(k for k, _ in ARCHITECTURE_BY_MODEL)})")
    from modules.benchmark.architectures import get_architecture
    arch = get_architecture(variant)
    buckets = ResolutionBucket.make_buckets(config.data.resolution, [16 / 9], arch.spatial_unit)
    height, width = buckets[0]
    frames = max(config.data.frame_buckets)
    arguments = ["--variant", variant, "--width", str(width), "--height", str(height), "--frames", str(frames),
                 "--steps", str(steps), "--dtype", "bf16", "--optimizer", config.optimizer.optimizer]
    weight = config.model.transformer.weight_dtype.value
    if config.training_method.value == "FINE_TUNE":
        arguments.append("--full")
    elif config.training_method.value == "LORA":
        arguments += ["--lora-rank", str(config.lora.rank), "--lora-targets", config.lora.targets]
        arguments += ["--weight-dtype", {"FLOAT_8": "fp8", "FLOAT_32": "fp32"}.get(weight, "bf16")]
    else:
        return PresetRun(name, reason=f"{config.training_method.value}: the benchmark times LoRA and fine-tunes")
    performance = config.performance
    if config.gradient_checkpointing:
        arguments += ["--gradient-checkpointing", "--checkpoint-every", str(performance.checkpoint_every)]
    if performance.block_swap:
        arguments += ["--block-swap", str(performance.block_swap)]
    if performance.activation_offload:
        arguments.append("--activation-offload")
    if performance.compile_blocks:
        arguments.append("--compile")
    if performance.attention != "auto":
        arguments += ["--attention", performance.attention]
    size = re.search(r"(\d+)\s*GB", name)
    cap = CAPS_GIB.get(int(size.group(1))) if size else None
    if cap is not None:
        arguments += ["--memory-cap-gib", str(cap)]
    return PresetRun(name, arguments, cap_gib=cap)


def preset_runs(steps: int = 3, only: str | None = None) -> list[PresetRun]:
    paths = sorted(PRESETS.glob("*.json"))
    if only:
        paths = [p for p in paths if only in p.stem]
        if not paths:
            raise ValueError(f"no preset in {PRESETS} has {only!r} in its name")
    return [preset_run(path, steps) for path in paths]


def run_presets(runs: list[PresetRun], workdir: Path, device: str, log=print) -> list[dict]:
    """Runs each preset's train benchmark in its own process; one result row per preset."""
    rows = []
    workdir.mkdir(parents=True, exist_ok=True)
    for index, run in enumerate(runs):
        if not run.arguments:
            rows.append({"preset": run.preset, "status": f"not run: {run.reason}"})
            log(f"{run.preset}: not run: {run.reason}")
            continue
        out = workdir / f"preset-{index}.json"
        arguments = run.arguments + ["--device", device, "--json", str(out)]
        log(f"{run.preset}: {run.command()}")
        process = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "train", *arguments],
                                 capture_output=True, text=True)
        row = {"preset": run.preset, "command": run.command(), "cap_gib": run.cap_gib, "exit_code": process.returncode}
        if out.is_file():
            result = json.loads(out.read_text(encoding="utf-8"))
            row.update(status=result.get("status"), seconds_per_step=result.get("seconds_per_step"),
                       tokens_per_second=result.get("tokens_per_second"), memory=result.get("memory"))
        else:
            row["status"] = f"failed (exit {process.returncode}): {process.stderr.strip().splitlines()[-1:]}"
        rows.append(row)
    return rows
