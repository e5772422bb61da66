"""Sampling with an accelerator: a step/CFG-distill LoRA on its own published schedule, guidance 1 (DESIGN.md 13).

The schedule is LightX2V's `WanStepDistillScheduler` (github.com/ModelTC/LightX2V,
lightx2v/models/schedulers/wan/step_distill/scheduler.py): sigmas `linspace(1, 0, 1001)[:-1]` shifted by
`shift * s / (1 + (shift - 1) * s)`, picked at index `1000 - t` for each t of the timestep list, the model called
at `sigma * 1000`, and each step `x0 = x - sigma * v; x = x0 + sigma_next * v` (sigma_next 0 after the last). That
is a flow-matching Euler step over those sigmas, so diffusers' FlowMatchEulerDiscreteScheduler given the sigmas with
shift 1 runs it (`AcceleratorScheduler`; tests/test_accelerator.py checks it against a transcription to 1e-5).

The file is read with the project's LoRA reader (every layout modules/util/lora/formats.py reads) plus ComfyUI's /
LightX2V's full-weight deltas (`.diff`, `.diff_b`). Low-rank modules act through forward hooks on the base layers
(the LoRA's output added, as LightX2V's runtime LoRA computes it), so no weight is touched; full-weight deltas are
added in place and the saved originals copied back after. Either way the transformer is bit-identical after the
sample and the trained adapters (peft layers wrap the base layers) are not involved.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor

from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.lora.accelerator_files import AcceleratorError, AcceleratorFile, read_accelerator_file


NUM_TRAIN_TIMESTEPS = 1000
EXPERTS = ("transformer", "transformer_2")


# ---------------------------------------------------------------------------------------------- the schedule

def accelerator_sigmas(timesteps: list[int], shift: float) -> list[float]:
    """The sigma of each listed timestep, as LightX2V's WanStepDistillScheduler.set_denoising_timesteps computes
    them (float32 torch arithmetic, the same operations)."""
    sigmas = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return [float(sigmas[NUM_TRAIN_TIMESTEPS - t]) for t in timesteps]


class AcceleratorScheduler(FlowMatchEulerDiscreteScheduler):
    """FlowMatchEulerDiscreteScheduler (shift 1: the sigmas are used as given, timesteps = sigmas * 1000, a final
    sigma 0 appended) that always sets the accelerator's sigmas, whatever step count the pipeline asks for."""

    accelerator_schedule: list[float] = []

    @classmethod
    def for_sigmas(cls, sigmas: list[float]) -> AcceleratorScheduler:
        scheduler = cls(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=1.0)
        scheduler.accelerator_schedule = list(sigmas)
        return scheduler

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        if num_inference_steps is not None and num_inference_steps != len(self.accelerator_schedule):
            raise ValueError(f"the accelerator runs {len(self.accelerator_schedule)} steps, not {num_inference_steps}")
        super().set_timesteps(device=device, sigmas=self.accelerator_schedule)


# ---------------------------------------------------------------------------------------------- the files

# ---------------------------------------------------------------------------------------------- the accelerator

@dataclass
class Accelerator:
    """A loaded accelerator: its files (per expert), strength and schedule."""
    config: AcceleratorConfig
    files: dict[str, AcceleratorFile]   # expert attribute ("transformer", "transformer_2") -> file

    @property
    def timesteps(self) -> list[int]:
        return self.config.timestep_list()

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def sigmas(self) -> list[float]:
        return accelerator_sigmas(self.timesteps, self.config.shift)

    def scheduler(self) -> AcceleratorScheduler:
        return AcceleratorScheduler.for_sigmas(self.sigmas)

    def record(self) -> dict:
        """What ran, for the JSON beside each output and the printed line."""
        files = {expert: str(file.path) for expert, file in self.files.items()}
        return {"file": files.get("transformer", ""), "file_2": files.get("transformer_2", ""),
                "strength": self.config.strength, "steps": self.steps, "timesteps": self.timesteps,
                "shift": self.config.shift, "guidance": 1.0}

    def describe(self) -> str:
        record = self.record()
        schedule = (f"{record['steps']} steps, timesteps {record['timesteps']}, shift {record['shift']:g}, "
                    f"guidance 1")
        if not self.files:   # a step-distilled base: its schedule, nothing added to the weights
            return f"the distilled base's own schedule: {schedule}"
        files = record["file"] + (f" + {record['file_2']}" if record["file_2"] else "")
        return f"accelerator {files} x{record['strength']:g}, {schedule}"


def load_accelerator(model, config: AcceleratorConfig) -> Accelerator:
    """The accelerator's files read against `model`'s transformers: `file` on the (high-noise) transformer, `file_2`
    on transformer_2 (`file` on both when `file_2` is empty). Without `file`: the schedule alone, for a base that is
    itself step-distilled (modules/util/distilled_base.py)."""
    if not config.file:
        return Accelerator(config, {})
    experts = [expert for expert in EXPERTS if getattr(model, expert, None) is not None]
    if config.file_2 and "transformer_2" not in experts:
        raise AcceleratorError(f"accelerator file_2 {config.file_2}: this model has one expert; leave file_2 empty")
    files = {}
    for expert in experts:
        path = config.file_2 if expert == "transformer_2" and config.file_2 else config.file
        files[expert] = read_accelerator_file(path, _module_names(getattr(model, expert)))
    return Accelerator(config, files)


def takes_accelerator(model) -> bool:
    """Whether `model`'s samples run on an accelerator's schedule (Animate and Animate-2 sample through their own
    pipelines and take none)."""
    variant = model.variant
    return not (variant.is_animate or variant.takes_driving_video)


def _module_names(transformer: torch.nn.Module) -> list[str]:
    from modules.util.lora.apply import _PEFT_PREFIX
    return [name.removeprefix(_PEFT_PREFIX) for name, _ in transformer.named_modules()]


def _lora_hook(down: Tensor, up: Tensor, scale: float):
    # an offloaded expert is placed on the sampling device after the hooks go in: its factors follow once
    placed = {down.device: (down, up)}

    def hook(module, args, output):
        x = args[0]
        if x.device not in placed:
            placed[x.device] = (down.to(x.device), up.to(x.device))
        d, u = placed[x.device]
        h = F.linear(F.linear(x.to(d.dtype), d), u)   # (..., in) -> (..., rank) -> (..., out)
        return output + (h * scale).to(output.dtype)
    return hook


def _parameter(transformer: torch.nn.Module, name: str) -> torch.nn.Parameter:
    from modules.util.lora.apply import _base_layer, _get_module
    module_name, _, attribute = name.rpartition(".")
    module = _get_module(transformer, module_name)
    if module is not None and getattr(_base_layer(module), "scale_weight", None) is not None:
        raise AcceleratorError(f"accelerator delta {name}: the layer holds fp8_scaled weights; a full-weight delta "
                               f"cannot be added to them (load the base in bf16 / fp32 to sample accelerated)")
    if module is not None and getattr(_base_layer(module), attribute, None) is not None:
        return getattr(_base_layer(module), attribute)
    owner_name, _, owner_attribute = module_name.rpartition(".")   # a bare parameter: scale_shift_table
    owner = _get_module(transformer, owner_name) if owner_name else transformer
    if attribute == "weight" and owner is not None and isinstance(getattr(owner, owner_attribute, None), Tensor):
        return getattr(owner, owner_attribute)
    raise AcceleratorError(f"accelerator delta {name}: no such parameter in the transformer")


@contextlib.contextmanager
def accelerated(model, accelerator: Accelerator | None) -> Iterator[None]:
    """Inside, each expert computes with its accelerator file at the accelerator's strength; after, the transformers
    are exactly as before (hooks removed, full-weight deltas' parameters copied back from their saved originals)."""
    if accelerator is None:
        yield
        return
    from modules.util.lora.apply import _base_layer, _get_module
    from modules.util.lora.formats import match_to_model
    strength = accelerator.config.strength
    handles, saved = [], []
    try:
        with torch.no_grad():
            for expert, file in accelerator.files.items():
                transformer = getattr(model, expert)
                if file.lora:
                    for name, lora in match_to_model(file.lora, _module_names(transformer)).items():
                        base = _base_layer(_get_module(transformer, name))
                        if not isinstance(base, torch.nn.Linear) or lora.dora_scale is not None \
                                or not hasattr(lora, "down"):
                            raise AcceleratorError(f"accelerator {file.path}: {name}: only plain LoRA on Linear "
                                                   f"layers is supported (this is {type(lora).__name__} on "
                                                   f"{type(base).__name__})")
                        dtype = base.weight.dtype if base.weight.dtype.is_floating_point and \
                            base.weight.element_size() > 1 else torch.bfloat16
                        # factors already placed on an accelerator (distill.mode preserve) stay there, also for a
                        # block that block swap holds on the host: the hook computes where its input is
                        device = lora.down.device if lora.down.device.type != "cpu" else base.weight.device
                        down, up = lora.down.to(device, dtype), lora.up.to(device, dtype)
                        handles.append(base.register_forward_hook(_lora_hook(down, up, strength * lora.scale)))
                for name, delta in file.deltas.items():
                    parameter = _parameter(transformer, name)
                    if delta.numel() != parameter.numel():
                        raise AcceleratorError(f"accelerator {file.path}: delta {name} {tuple(delta.shape)} does not "
                                               f"fit {tuple(parameter.shape)}")
                    saved.append((parameter, parameter.detach().clone()))
                    merged = parameter.float() + strength * delta.to(parameter.device, torch.float32).reshape(
                        parameter.shape)
                    parameter.copy_(merged.to(parameter.dtype))
        yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for parameter, original in reversed(saved):
                parameter.copy_(original)
