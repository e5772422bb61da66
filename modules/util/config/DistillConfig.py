"""`distill`: how a LoRA is trained with a step-distill accelerator in mind (docs/distilled.md).

`mode` "base" (the only one built): the LoRA trains on the base model as usual; with `sampling.accelerator` set,
each preview also measures how far the accelerated sample of base + LoRA departs from the full-step one of the same
seed (the stack check, modules/modelSampler/stack_check.py).
"""
from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig

DISTILL_MODES = ("base",)
NOT_BUILT_MODES = ("preserve",)   # named in docs/distilled.md; refused with "not built yet" until they are


class DistillConfig(BaseConfig):
    mode: Literal["base"] = Field("base", description="base: train on the base model as usual (the stack check "
                                  "measures each preview against the accelerator); 'preserve' is not built yet")
    stack_check: bool = Field(True, description="with sampling.accelerator: each preview is also made at its own "
                              "full steps and guidance without the accelerator, and the two are compared (a second "
                              "sample per preview)")

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value):
        # the message names what is allowed and says plainly that a named mode is not built, rather than pydantic's
        # bare "Input should be 'base'"
        if value in DISTILL_MODES:
            return value
        allowed = ", ".join(repr(mode) for mode in DISTILL_MODES)
        if value in NOT_BUILT_MODES:
            raise ValueError(f"{value!r} (training that keeps the LoRA working with the accelerator) is not built "
                             f"yet; allowed: {allowed}")
        raise ValueError(f"{value!r} is not a distill mode; allowed: {allowed}")
