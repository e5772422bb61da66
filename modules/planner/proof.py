"""`benchmark.py proof`: on one GPU, everything docs/benchmarks.md needs, with the planner's prediction next to
every measured peak. Random weights at real size, built on the device; nothing downloaded.

Runs, each in its own process (a memory cap is per process, and each must start from an empty device):
1. Wan2.1 1.3B LoRA r32 at 832x480x81, with and without gradient checkpointing, each beside the plain diffusers +
   peft step (`benchmark train --baseline`): s/step, tokens/s, MFU, peak.
2. Wan2.1 14B LoRA r32 at 832x480x81 under a 22 GiB cap with the settings the planner fits to 22 GiB, and
   uncapped with no memory switch but checkpointing.
3. Wan2.2 TI2V-5B LoRA at 704x1280x121 under a 24 GiB cap with the planner's settings for 24 GiB.
4. Every shipped preset for 10 steps under the cap its name implies (`benchmark presets`).
Writes proof.md (the table) and proof.json to the work folder. Targets: 1.3B LoRA >= 1.3x the plain
step, MFU >= 50 %, <= 8 GiB with checkpointing; 14B capped within 1.6x of uncapped; the planner within 10 % of
every measured peak.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


@dataclass
class ProofRun:
    name: str
    arguments: list[str]                 # benchmark.py train arguments
    cap_gib: float | None = None
    fit_gib: float | None = None         # the planner picks the memory switches for this budget first
    notes: list[str] = field(default_factory=list)


def proof_runs(quick: bool) -> list[ProofRun]:
    steps = ["--steps", "1" if quick else "5"]
    base_13b = ["--variant", "wan2.1-1.3b", "--width", "832", "--height", "480", "--frames", "81",
                "--lora-rank", "32", *steps]
    base_14b = ["--variant", "wan2.1-14b", "--width", "832", "--height", "480", "--frames", "81",
                "--lora-rank", "32", "--weight-dtype", "fp8", *steps]
    base_5b = ["--variant", "wan2.2-5b", "--width", "1280", "--height", "704", "--frames", "121",
               "--lora-rank", "32", *steps]
    return [
        ProofRun("1.3B LoRA r32 832x480x81, checkpointing", [*base_13b, "--gradient-checkpointing", "--baseline"]),
        ProofRun("1.3B LoRA r32 832x480x81, no checkpointing", [*base_13b, "--baseline"]),
        ProofRun("14B LoRA r32 832x480x81, uncapped", [*base_14b, "--gradient-checkpointing"]),
        ProofRun("14B LoRA r32 832x480x81, 22 GiB cap, planner's settings", base_14b, cap_gib=22.0, fit_gib=22.0),
        ProofRun("TI2V-5B LoRA r32 704x1280x121, 24 GiB cap, planner's settings", base_5b, cap_gib=24.0,
                 fit_gib=24.0),
    ]


def _bench_config(arguments: list[str]):
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark
    from modules.benchmark.train_bench import TrainBenchConfig
    args = benchmark._parser().parse_args(["train", *arguments])
    return TrainBenchConfig(variant=args.variant, width=args.width, height=args.height, frames=args.frames,
                            steps=args.steps, dtype=args.dtype, weight_dtype=args.weight_dtype,
                            gradient_checkpointing=args.gradient_checkpointing,
                            checkpoint_every=args.checkpoint_every, block_swap=args.block_swap,
                            activation_offload=args.activation_offload, optimizer=args.optimizer,
                            lora_rank=None if args.full else args.lora_rank, lora_targets=args.lora_targets,
                            batch_size=args.batch_size, device="cuda")


def _planned(arguments: list[str], fit_gib: float | None) -> tuple[list[str], object, str]:
    """(the arguments with the planner's switches for `fit_gib`, its prediction, the switches in words)."""
    from modules.benchmark.architectures import get_architecture
    from modules.benchmark.train_bench import _train_config
    from modules.planner.memory_plan import fit, predict
    from modules.planner.plan_shapes import PlanShape
    from modules.util.enum.DataType import DataType
    cfg = _bench_config(arguments)
    arch = get_architecture(cfg.variant)
    config = _train_config(arch, cfg)
    # the benchmark builds the frozen weights in --weight-dtype (default: --dtype)
    config.model.transformer.weight_dtype = {"fp8": DataType.FLOAT_8, "bf16": DataType.BFLOAT_16,
                                             "fp32": DataType.FLOAT_32}[cfg.weight_dtype or cfg.dtype]
    shape = PlanShape(cfg.batch_size, cfg.frames, cfg.height, cfg.width)
    words = "as given"
    if fit_gib is not None:
        from modules.planner.auto_fit import canonical, settings_of
        result = fit(config, fit_gib, arch=arch, shape=shape)
        if result.settings is None:
            return arguments, None, result.text()
        settings = canonical(result.settings, arch.transformer["num_layers"])
        config = settings.apply(config)
        arguments = [*arguments, *(["--gradient-checkpointing", "--checkpoint-every",
                                    str(settings.checkpoint_every)] if settings.gradient_checkpointing else []),
                     "--block-swap", str(settings.block_swap),
                     *(["--activation-offload"] if settings.activation_offload else [])]
        words = settings.text()
    return arguments, predict(config, shape, arch=arch), words


def _run(arguments: list[str], cap_gib: float | None, out: Path) -> dict:
    command = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "train", *arguments, "--device", "cuda",
               "--json", str(out), *(["--memory-cap-gib", str(cap_gib)] if cap_gib else [])]
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True)
    result = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    result.update(command=" ".join(command[1:]), exit_code=process.returncode,
                  wall_seconds=time.perf_counter() - started)
    if not out.is_file():
        result["status"] = f"failed (exit {process.returncode}): {process.stderr.strip().splitlines()[-1:]}"
    return result


def run_proof(workdir: Path, quick: bool = False, log=print) -> int:
    import torch
    if not torch.cuda.is_available():
        print("benchmark proof: needs a CUDA GPU (it measures peaks to set beside the planner's predictions); "
              "this machine has none", file=sys.stderr)
        return 2
    from modules.benchmark.common import environment, write_json
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, run in enumerate(proof_runs(quick)):
        arguments, prediction, words = _planned(run.arguments, run.fit_gib)
        log(f"{run.name}: {words}; predicted {prediction.peak_gib:.1f} GiB" if prediction else f"{run.name}: {words}")
        if prediction is None:
            rows.append({"run": run.name, "status": f"not run: {words}"})
            continue
        result = _run(arguments, run.cap_gib, workdir / f"proof-{index}.json")
        measured = (result.get("memory") or {}).get("peak_allocated_gib")
        row = {"run": run.name, "switches": words, "status": result.get("status"),
               "seconds_per_step": result.get("seconds_per_step"), "tokens_per_second": result.get("tokens_per_second"),
               "mfu": result.get("mfu"), "measured_peak_gib": measured, "predicted_peak_gib": prediction.peak_gib,
               "predicted_traced_gib": prediction.traced_bytes / GIB,
               "prediction_error": (prediction.traced_bytes / GIB - measured) / measured if measured else None,
               "baseline": result.get("baseline"), "speedup_vs_baseline": result.get("speedup_vs_baseline"),
               "command": result.get("command")}
        log(f"  {row['status']}: {row['seconds_per_step']} s/step, measured {measured} GiB")
        rows.append(row)
    from modules.benchmark.preset_bench import preset_runs, run_presets
    preset_rows = run_presets(preset_runs(1 if quick else 10), workdir / "presets", "cuda", log)
    data = {"environment": environment(), "quick": quick, "runs": rows, "presets": preset_rows}
    write_json(workdir / "proof.json", data)
    (workdir / "proof.md").write_text(proof_markdown(data), encoding="utf-8")
    log(proof_markdown(data))
    return 0


def proof_markdown(data: dict) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"Measured on {data['environment'].get('gpu', '?')} by `benchmark proof`"
             + (" (--quick: 1 step)" if data.get("quick") else ""), "",
             "| run | memory switches | status | s / step | tokens / s | MFU | measured peak GiB (allocated) | "
             "planner (traced) GiB | planner error | vs plain diffusers + peft |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["runs"]:
        speedup = f"{row['speedup_vs_baseline']:.2f}x" if row.get("speedup_vs_baseline") else "-"
        lines.append(f"| {row['run']} | {row.get('switches', '-')} | {row.get('status')} | "
                     f"{number(row.get('seconds_per_step'), '.3f')} | {number(row.get('tokens_per_second'), ',.0f')} | "
                     f"{number(row.get('mfu'), '.1%')} | {number(row.get('measured_peak_gib'), '.2f')} | "
                     f"{number(row.get('predicted_traced_gib'), '.2f')} | "
                     f"{number(row.get('prediction_error'), '+.1%')} | "
                     f"{speedup} |")
    lines += ["", "| preset | cap GiB | status | s / step | measured peak GiB |", "|---|---|---|---|---|"]
    for row in data["presets"]:
        lines.append(f"| {row['preset']} | {number(row.get('cap_gib'), 'g')} | {row['status']} | "
                     f"{number(row.get('seconds_per_step'), '.3f')} | "
                     f"{number((row.get('memory') or {}).get('peak_allocated_gib'), '.2f')} |")
    return "\n".join(lines) + "\n"
