from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class ControlConfig(BaseConfig):
    """Control models' data settings (VACE: docs/vace.md)."""

    derive: Literal["none", "canny", "gray"] = Field(
        "none", description="a clip without a control file of its own gets one computed from its own frames at cache "
        "time with OpenCV as the official VACE annotators do: 'canny' edges (thresholds 100 / 200, white on "
        "black) or 'gray'; 'none': such a clip trains with a zero control (a dataset where no clip has one is "
        "refused). A clip's own control file always wins")
    loss_region: Literal["mask", "all"] = Field(
        "mask", description="'mask': the loss falls on the region the control mask marks to generate (white); "
        "'all': on every pixel, the mask only conditioning the model")
