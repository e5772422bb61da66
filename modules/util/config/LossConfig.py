from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_MASK_GAMMA


class LossConfig(BaseConfig):
    """How the flow-matching loss is weighted over the latent (docs/masks.md)."""

    mask_min_weight: float = Field(0.0, ge=0, le=1, description="with masks: the weight of the black (ignored) "
                                   "parts of a clip's mask, so they still learn a little; 0: not at all")
    mask_gamma: float = Field(1.0, gt=0, le=MAX_MASK_GAMMA, description="with masks: the weight is mask ** gamma "
                              "before mask_min_weight; above 1 sharpens grey parts towards black, below 1 lifts them "
                              "(blissful-tuner's --mask_gamma)")
    skip_conditioned_frames: bool = Field(False, description="I2V / FLF2V: leave the given frame's latent frame "
                                          "(first, and last for FLF2V) out of the loss")
