from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class AnimateConfig(BaseConfig):
    """Wan2.2-Animate training (docs/animate.md): which conditions each clip is trained under."""

    mode: Literal["animate", "replace"] = Field("animate", description="animate: the character is driven by the "
                                                "pose and face videos; replace: also put into the background video "
                                                "under the mask (needs <name>_bg and <name>_mask)")
    continuation_frames: Literal[0, 1, 5] = Field(0, description="0: each clip is a first segment; 1 or 5: the "
                                                  "clip's first frames condition the rest, as a later segment of a "
                                                  "long video is continued (no loss on them)")
