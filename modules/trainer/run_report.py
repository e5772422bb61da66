"""What a run will do, planned before its first step, and what it did, told to the user at its end.

The plan: `max_steps`, when set, wins over `epochs` (the epochs repeat as often as needed, as in musubi-tuner), and
the LR schedule, previews, backups and saves are laid out on the optimizer steps that will really run. Gradient
accumulation counts batches across epoch ends, so a run of E epochs of B batches makes floor(E * B / accumulation)
optimizer steps.

The run's folders: the workspace (`workspace_dir`) holds the backups, which every run in it shares so that
`backup.continue_last_backup` finds the newest one; each run writes its TensorBoard log and previews into its own
folders named after the run (`run_name`, by default the start time): `<workspace>/tensorboard/<run>/` and
`<workspace>/samples/<run>/`. A resumed run continues under the name of the run that wrote the backup.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.DataType import DataType

ROOT = Path(__file__).resolve().parents[2]

# a transformer this large is a real Wan model (the smallest, Wan 2.1 T2V 1.3B, has 1.4 B parameters)
GPU_SIZED_PARAMETERS = 500_000_000


@dataclass
class RunPlan:
    batches_per_epoch: int
    accumulation: int
    total_steps: int       # optimizer steps the run makes
    epochs: int            # epochs that start (the last one may end early at max_steps)
    max_steps_wins: bool   # max_steps was set and needs more epochs than `epochs` says

    def end_of_epoch_step(self, epoch: int) -> int:
        """The optimizer step count when epoch `epoch` (0-based) ends."""
        return (epoch + 1) * self.batches_per_epoch // self.accumulation


class PlanError(ValueError):
    pass


def plan_run(config: TrainConfig, batches_per_epoch: int) -> RunPlan:
    accumulation = config.optimizer.gradient_accumulation_steps
    if batches_per_epoch < 1:
        raise PlanError("the data gives no batch in an epoch")
    if config.max_steps:
        epochs = math.ceil(config.max_steps * accumulation / batches_per_epoch)
        return RunPlan(batches_per_epoch, accumulation, config.max_steps, epochs, epochs > config.epochs)
    total = config.epochs * batches_per_epoch // accumulation
    if total < 1:
        raise PlanError(f"optimizer.gradient_accumulation_steps {accumulation} is more than the "
                        f"{config.epochs * batches_per_epoch} batches of the whole run ({config.epochs} epochs of "
                        f"{batches_per_epoch}): no optimizer step would run")
    return RunPlan(batches_per_epoch, accumulation, total, config.epochs, False)


def scheduled_steps(plan: RunPlan, every_steps: int, every_epochs: int) -> list[int]:
    """The optimizer steps after which a step / epoch schedule fires in this plan."""
    steps = set(range(every_steps, plan.total_steps + 1, every_steps)) if every_steps else set()
    if every_epochs:
        steps |= {plan.end_of_epoch_step(e) for e in range(plan.epochs) if (e + 1) % every_epochs == 0
                  and plan.end_of_epoch_step(e) <= plan.total_steps}
    return sorted(steps)


def describe_schedule(plan: RunPlan, every_steps: int, every_epochs: int, every_minutes: float = 0.0) -> str:
    steps = scheduled_steps(plan, every_steps, every_epochs)
    parts = []
    if steps:
        shown = ", ".join(str(s) for s in steps[:6]) + (f", ... ({len(steps)} in all)" if len(steps) > 6 else "")
        parts.append(f"after steps {shown}")
    if every_minutes:
        parts.append(f"every {every_minutes:g} minutes")
    return "; ".join(parts) if parts else "never"


# ---- the run's name and folders -------------------------------------------------------------------------------

def resolve_run_name(config: TrainConfig, workspace: Path, resume=None) -> str:
    """`run_name` when set; on a resume the name of the run it continues (`resume`, a backup_io.ResumeChoice); else
    the start time. A new name is reserved by creating its backup folder exclusively, with a counter when that
    fails or the name's other folders exist: two runs started in the same second never share folders (one
    TensorBoard run, one recorded config, each pruning the other's backups)."""
    if config.run_name:
        return config.run_name
    if resume is not None and resume.folder is not None and resume.run_name:
        return resume.run_name
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    (workspace / "backup").mkdir(parents=True, exist_ok=True)
    name, number = stamp, 1
    while True:
        if not any((workspace / kind / name).exists() for kind in ("tensorboard", "samples")):
            try:
                (workspace / "backup" / name).mkdir()
                return name
            except FileExistsError:
                pass
        number += 1
        name = f"{stamp}-{number}"


# ---- the start -------------------------------------------------------------------------------------------------

def _count(value: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return str(value)


def adapter_layer_count(model, experts: list[str]) -> int:
    """Modules wrapped by a peft adapter (LoRA, DoRA, LoHa, LoKr) in the experts that train."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return sum(isinstance(m, BaseTunerLayer) for e in experts for m in getattr(model, e).modules())


def gpu_sized_reasons(config: TrainConfig, transformer_parameters: int) -> list[str]:
    reasons = []
    if config.train_dtype in (DataType.BFLOAT_16, DataType.FLOAT_16):
        reasons.append(f"train_dtype {config.train_dtype.value}")
    if config.optimizer.optimizer.endswith("_8BIT"):
        reasons.append(f"optimizer {config.optimizer.optimizer}")
    if any(getattr(config.model, part).weight_dtype is DataType.FLOAT_8 for part in ("transformer", "transformer_2")):
        reasons.append("FLOAT_8 transformer weights")
    if transformer_parameters >= GPU_SIZED_PARAMETERS:
        reasons.append(f"a {_count(transformer_parameters)}-parameter transformer")
    return reasons


def device_warning(config: TrainConfig, device: torch.device, transformer_parameters: int) -> str | None:
    """A warning when `device: auto` fell back to the CPU for a config made for a GPU."""
    if config.device != "auto" or device.type != "cpu":
        return None
    reasons = gpu_sized_reasons(config, transformer_parameters)
    if not reasons:
        return None
    return (f"WARNING: device is 'auto' and no CUDA GPU was found, so this run trains on the CPU, but the config is "
            f"made for a GPU ({', '.join(reasons)}): it will be very slow. Check the GPU driver / the CUDA build of "
            f"torch, or set device=cpu and train_dtype=FLOAT_32 to train on the CPU on purpose.")


def start_report(trainer, parameters: list[torch.nn.Parameter]) -> str:
    from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
    config, model, plan = trainer.config, trainer.model, trainer.plan
    experts = trainer.setup.experts_in_training()
    transformer_parameters = sum(p.numel() for p in model.transformer.parameters())
    lines = ["run plan:"]
    warning = device_warning(config, trainer.device, transformer_parameters)
    if warning:
        lines.append("  " + warning)
    lines.append(f"  model: {model.variant} ({model.variant.model_type.value}) from {config.model.base_model_name}, "
                 f"transformer {_count(transformer_parameters)} parameters")
    lines += [f"    {message}" for message in model.part_messages]
    if model.sampling_defaults is not None:   # a base read from files: no scheduler config of its own
        lines.append(f"    sampling (previews, sample.py): the official {model.variant} settings where a sample sets "
                     f"none: {model.sampling_defaults.describe()}")
    from modules.util.config.image_encoder_source import image_encoder_description
    encoder = image_encoder_description(config, model)
    if encoder:
        lines.append("  " + encoder)
    lines.append(f"  device: {trainer.device} (config: {config.device})")
    weights = ", ".join(f"{part} {getattr(config.model, part).weight_dtype.value}" for part in
                        ("transformer", "transformer_2", "text_encoder") if getattr(model, part, None) is not None)
    lines.append(f"  dtypes: train {config.train_dtype.value}; weights {weights}; output {config.output.dtype.value}")
    trainable = sum(p.numel() for p in parameters)
    method = config.training_method.value
    lines.append(f"  trains: {method} on {', '.join(experts) if method != 'EMBEDDING' else 'the text encoder'}, "
                 f"{trainable:,} trainable parameters ({_count(trainable)})")
    if method == "LORA":
        lora = config.lora
        targets = lora.targets if lora.targets != "custom" else f"custom {lora.custom_targets}"
        lines.append(f"  {lora.type}{' + DoRA' if lora.dora else ''} rank {lora.rank} alpha {lora.alpha:g}: targets "
                     f"{targets}, {adapter_layer_count(model, experts)} modules")
    lines.append(f"  steps: {plan.total_steps} optimizer steps = {plan.total_steps * plan.accumulation} batches of "
                 f"{config.batch_size} over {plan.epochs} epoch(s) of {plan.batches_per_epoch} batches"
                 + (f", accumulation {plan.accumulation}" if plan.accumulation > 1 else ""))
    if plan.max_steps_wins:
        lines.append(f"    max_steps {config.max_steps} wins over epochs {config.epochs}: the epochs repeat as needed")
    optimizer = config.optimizer
    lines.append(f"  optimizer: {optimizer.optimizer} lr {optimizer.learning_rate:g}, schedule {optimizer.scheduler} "
                 f"over {plan.total_steps} steps" + (f", warmup {optimizer.warmup_steps}" if optimizer.warmup_steps
                                                     else ""))
    from modules.trainer.parameter_groups import describe_groups
    groups = describe_groups(trainer.optimizer)
    if groups:
        lines.append(f"  parameter groups: {groups}")
    timestep = config.timestep
    shift = f" (shift {timestep.shift:g})" if timestep.distribution.endswith("shift") else ""
    lines.append(f"  timesteps: {timestep.distribution}{shift}")
    buckets = ResolutionBucket.make_buckets(config.data.resolution, config.data.aspect_ratios, model.spatial_unit)
    lines.append(f"  buckets: resolution {config.data.resolution!s} -> "
                 f"{', '.join(f'{w}x{h}' for h, w in buckets)} (width x height); frames {config.data.frame_buckets}")
    for concept in config.data.concepts:  # a concept's own buckets (a diffusion-pipe directory's)
        if concept.enabled and (concept.resolution, concept.aspect_ratios, concept.frame_buckets) != (None,) * 3:
            resolution = concept.resolution if concept.resolution is not None else config.data.resolution
            own = ResolutionBucket.make_buckets(resolution, concept.aspect_ratios or config.data.aspect_ratios,
                                                model.spatial_unit)
            lines.append(f"    concept {concept.name or concept.path}: resolution {resolution!s} -> "
                         f"{', '.join(f'{w}x{h}' for h, w in own)}; frames "
                         f"{concept.frame_buckets or config.data.frame_buckets}")
    if config.distill.mode == "preserve":
        accelerator = config.sampling.accelerator
        attached = f"the accelerator {' + '.join(f for f in (accelerator.file, accelerator.file_2) if f)} attached " \
            f"(frozen, strength {accelerator.strength:g})" if accelerator.enabled else "the distilled release itself"
        teacher = (f"teacher matching weight {config.distill.preserve_weight:g} (a second forward pass a step, "
                   f"without your LoRA)") if config.distill.preserve_weight else "no teacher term (preserve_weight 0)"
        lines.append(f"  distill: preserve: trains on {attached}; {teacher}")
    backup = config.backup
    when = describe_schedule(plan, backup.every_n_steps, backup.every_n_epochs, backup.every_n_minutes)
    if backup.backup_before_save:
        when = "before the final save" if when == "never" else f"{when}; before the final save"
    lines.append(f"  backups: {trainer.backup_root} ({when}; Ctrl-C also writes one)")
    if backup.save_every_n_steps or backup.save_every_n_epochs:
        lines.append(f"  intermediate saves: {Path(config.workspace_dir) / 'save'} "
                     f"({describe_schedule(plan, backup.save_every_n_steps, backup.save_every_n_epochs)})")
    if config.sampling.samples_file:
        sampling = config.sampling
        when = describe_schedule(plan, sampling.every_n_steps, sampling.every_n_epochs, sampling.every_n_minutes)
        before = "before training and " if sampling.sample_before_training else ""
        lines.append(f"  previews: {trainer.samples_dir} ({before}{when})")
        if sampling.accelerator.enabled and config.distill.stack_check and config.distill.mode == "base":
            lines.append(f"    stack check: each accelerated preview is also made at its own steps and guidance "
                         f"without the accelerator (<step>-<epoch>-full.mp4) and the two compared: the sample's "
                         f"full steps (two passes each with guidance above 1) on top of the accelerator's "
                         f"{len(sampling.accelerator.timestep_list())} (distill.stack_check false: off)")
    else:
        lines.append("  previews: none (sampling.samples_file is empty)")
    if getattr(trainer, "validation", None) is not None:
        lines.append(trainer.validation.plan_line())
    if config.tensorboard:
        lines.append(f"  TensorBoard: {trainer.tensorboard_dir}")
    from modules.trainer.output_files import final_output_paths, plan_lines
    files = final_output_paths(trainer)
    named = "" if files == [Path(config.output.destination)] else f": {', '.join(str(p) for p in files)}"
    lines.append(f"  output: {config.output.destination} ({config.output.format.value}){named}")
    lines += plan_lines(trainer)
    return "\n".join(lines)


# ---- the end ---------------------------------------------------------------------------------------------------

def _quote(path) -> str:
    """A path for a command line, absolute when it exists (the user may run the command from elsewhere)."""
    return shlex.quote(str(Path(path).resolve()) if Path(path).exists() else str(path))


def lora_to_sample(written: list[Path]) -> str:
    """The --lora argument that samples the run's LoRA, absolute: an A14B pair is named by its stem (sample.py reads
    `_high_noise` / `_low_noise`), a file that does not exist, so it is resolved through its folder."""
    first = Path(written[0]).resolve()
    if len(written) > 1:
        first = first.with_name(first.name.replace("_high_noise", "").replace("_low_noise", ""))
    return shlex.quote(str(first))


def tensorboard_command(logdir: Path) -> str:
    executable = Path(sys.executable).parent / "tensorboard"
    return f"{_quote(executable) if executable.exists() else 'tensorboard'} --logdir {_quote(logdir)}"


def previews_by_step(folder: Path) -> list[Path]:
    """A run's preview videos in step order (by name '50-8.mp4' sorts after '200-33.mp4'; a file's time says
    when it was rendered, which a resume or a GUI 'sample now' reorders)."""
    from modules.modelSampler.TrainingSampler import preview_step
    return sorted(folder.rglob("*.mp4"), key=lambda p: (preview_step(p), str(p))) if folder.is_dir() else []


def end_report(trainer, written: list[Path], config_path: Path | None) -> str:
    from modules.trainer.backup_io import newest_usable_backup
    config = trainer.config
    run_cmd = _quote(ROOT / "run-cmd.sh")
    lines = ["run finished:"]
    for path in written:
        lines.append(f"  wrote {path}")
    samples = previews_by_step(trainer.samples_dir)
    if samples:
        lines.append(f"  previews: {len(samples)} videos in {trainer.samples_dir}, the last {samples[-1]}")
    from modules.modelSampler.stack_check import report_lines
    lines += report_lines(getattr(getattr(getattr(trainer, "hooks", None), "sampler", None), "stack_checks", []))
    newest_backup = newest_usable_backup(trainer.backup_root)[0]
    if newest_backup is not None:
        lines.append(f"  newest backup: {newest_backup}")
    if getattr(trainer, "validation", None) is not None:
        lines.append(trainer.validation.end_line(written))
    from modules.util.lora.format_notes import config_format_notes
    lines += [f"  note: {note}" for note in (config_format_notes(config) if written else [])]
    lines.append("next:")
    method = config.training_method.value
    inference = shlex.quote(str(Path(config.workspace_dir).resolve() / "inference"))
    e2v_options = ""
    if config.e2v.enabled:
        # the LoRA's header (a fine-tune's e2v_config.json) records the layout and image encoder: the elements by
        # name, the required ones to fill in, the optional ones after a shell comment
        elements = trainer.e2v_datasets[0].elements_in_position_order() if trainer.e2v_datasets else []
        e2v_options = "".join(f" --element {e.name}=IMAGE" for e in elements if e.required) or \
            " --element NAME=IMAGE"
        optional = [f"--element {e.name}=IMAGE" for e in elements if not e.required]
        e2v_options += f"  # optional: {' '.join(optional)}" if optional else ""
    if method == "LORA" and written:
        lines.append(f"  sample with the LoRA:  {run_cmd} sample --base-model-name "
                     f"{_quote(config.model.base_model_name)} --lora {lora_to_sample(written)} --prompt \"...\" "
                     f"--output-dir {inference}" + e2v_options)
    elif method == "FINE_TUNE" and written and config.output.format.value == "DIFFUSERS":
        lines.append(f"  sample the model:  {run_cmd} sample --base-model-name {_quote(written[0])} "
                     f"--prompt \"...\" --output-dir {inference}")
    if config_path is not None and newest_backup is not None:
        # the run's config names its paths as given: relative ones are read from this folder
        lines.append(f"  train on from the newest backup (raise max_steps or epochs to go further):  cd "
                     f"{shlex.quote(os.getcwd())} && {run_cmd} train --config-path {_quote(config_path)} "
                     f"--config-value backup.continue_last_backup=true")
    if config.tensorboard:
        lines.append(f"  TensorBoard (every run of this workspace):  "
                     f"{tensorboard_command(Path(config.workspace_dir) / 'tensorboard')}")
    return "\n".join(lines)
