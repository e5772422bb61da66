"""`distill`: how a LoRA is trained with a step-distill accelerator in mind (docs/distilled.md).

`mode` "base": the LoRA trains on the base model as usual; with `sampling.accelerator` set, each preview also
measures how far the accelerated sample of base + LoRA departs from the full-step one of the same seed (the stack
check, modules/modelSampler/stack_check.py).

`mode` "preserve": the LoRA trains with the accelerator (`sampling.accelerator`) attached and frozen, and a
preservation term holds the accelerated model's own predictions on the empty caption (or on the step's own inputs,
`preserve_on`) where the data does not move them (modules/modelSetup/distill_preserve.py).
"""
from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig

DISTILL_MODES = ("base", "preserve")


class DistillConfig(BaseConfig):
    mode: Literal["base", "preserve"] = Field(
        "base", description="base: train on the base model as usual (the stack check measures each preview against "
        "the accelerator); preserve: train with sampling.accelerator attached (frozen) and a preservation term, so "
        "the LoRA keeps working on the accelerator's few steps")
    stack_check: bool = Field(True, description="with sampling.accelerator: each preview is also made at its own "
                              "full steps and guidance without the accelerator, and the two are compared (a second "
                              "sample per preview)")
    preserve_weight: float = Field(0.5, ge=0.0, le=100.0, description="preserve: the weight of the preservation term (the "
                                   "squared distance of the prediction from the frozen accelerated model's own, "
                                   "without your LoRA) beside the data loss; 0: the accelerator attached, no term")

    preserve_on: Literal["empty_caption", "caption"] = Field(
        "empty_caption", description="preserve: the inputs the teacher term compares on. empty_caption: the step's "
        "noisy latents with the empty caption (ai-toolkit's differential output preservation: your captions are left "
        "to the data); caption: the step's own inputs")

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value):
        # the message names what is allowed, rather than pydantic's bare "Input should be 'base' or 'preserve'"
        if value in DISTILL_MODES:
            return value
        allowed = ", ".join(repr(mode) for mode in DISTILL_MODES)
        raise ValueError(f"{value!r} is not a distill mode; allowed: {allowed}")


def distilled_release(base_model_name: str) -> bool:
    """Whether the base model folder is a step-distilled release (its model_index.json names the distilled Animate-2
    pipeline): preserve then trains on it directly, the teacher being the release itself. Reads one JSON file."""
    import json
    from pathlib import Path

    from modules.model.sampling_defaults import DISTILLED_ANIMATE_2_PIPELINE
    index = Path(base_model_name or "") / "model_index.json"
    try:
        return json.loads(index.read_text(encoding="utf-8")).get("_class_name") == DISTILLED_ANIMATE_2_PIPELINE
    except (OSError, ValueError, AttributeError):
        return False


def distill_problems(config) -> list[str]:
    """What keeps a run's `distill` section from training as asked (before any model loads)."""
    if config.distill.mode != "preserve":
        return []
    problems = []
    if not config.sampling.accelerator.file and not distilled_release(config.model.base_model_name):
        problems.append("distill.mode: 'preserve' trains with the accelerator attached: set sampling.accelerator.file "
                        "(the accelerator LoRA, e.g. lightx2v's or Wan2.2-Lightning's), train on a distilled release "
                        "(Animate-2's), or use distill.mode 'base'")
    if config.training_method.value != "LORA":
        problems.append(f"distill.mode: 'preserve' trains a LoRA beside the frozen accelerator; training_method is "
                        f"{config.training_method.value} (use LORA, or distill.mode 'base')")
    return problems
