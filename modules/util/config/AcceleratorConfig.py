"""`sampling.accelerator`: a step/CFG-distill LoRA (lightx2v, Wan2.2-Lightning, CausVid, ...) that previews, `sample`
and validation run with, on its own published schedule (DESIGN.md section 13). It is a sampling setting: it is added
around each sample and removed after, never part of the LoRA being trained.

The schedule is LightX2V's `WanStepDistillScheduler` (lightx2v/models/schedulers/wan/step_distill/scheduler.py): a
timestep list out of 1000 (configs/distill/*.json: `denoising_step_list` [1000, 750, 500, 250]), each mapped to the
shifted sigma `shift * s / (1 + (shift - 1) * s)` of s = t / 1000 (`sample_shift` 5), guidance 1 (`enable_cfg` false).
"""
from pydantic import Field, model_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_LORA_STRENGTH, PathText

LIGHTX2V_TIMESTEPS = [1000, 750, 500, 250]   # configs/distill/wan21/*_4step_cfg.json, configs/distill/wan22/*.json
LIGHTX2V_SHIFT = 5.0                          # the same configs' sample_shift


def even_timesteps(steps: int) -> list[int]:
    """`steps` timesteps evenly spaced down from 1000 (4 -> LightX2V's [1000, 750, 500, 250])."""
    return [1000 - (1000 * k) // steps for k in range(steps)]


class AcceleratorConfig(BaseConfig):
    file: PathText = Field("", description="the accelerator LoRA (safetensors); empty: previews are not accelerated. "
                           "Wan 2.2 A14B: the high-noise expert's file")
    file_2: PathText = Field("", description="Wan 2.2 A14B: the low-noise expert's file (Wan2.2-Lightning "
                             "low_noise_model); empty: `file` on both experts")
    strength: float = Field(1.0, ge=-MAX_LORA_STRENGTH, le=MAX_LORA_STRENGTH)
    steps: int = Field(4, ge=1, le=1000, description="denoising steps; the timesteps are evenly spaced down from 1000 "
                       "unless `timesteps` lists them")
    timesteps: list[int] = Field([], max_length=1000, description="the timestep list out of 1000, highest first "
                                 "(LightX2V's denoising_step_list); empty: evenly spaced by `steps`")
    shift: float = Field(LIGHTX2V_SHIFT, gt=0, le=100, description="sigma shift applied to the list (LightX2V's "
                         "sample_shift)")

    @model_validator(mode="before")
    @classmethod
    def _a_bare_path_is_the_file(cls, value):
        # `--config-value sampling.accelerator=x.safetensors`: the file, the rest at their defaults
        return {"file": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _timesteps_in_range(self):
        listed = self.timesteps
        if any(not 1 <= t <= 1000 for t in listed):
            raise ValueError(f"accelerator timesteps {listed}: each must be in 1..1000")
        if any(a <= b for a, b in zip(listed, listed[1:])):
            raise ValueError(f"accelerator timesteps {listed}: must go strictly down (highest noise first)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.file)

    def timestep_list(self) -> list[int]:
        return list(self.timesteps) if self.timesteps else even_timesteps(self.steps)
