from typing import Any, Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import PathText
from modules.util.config.E2VConfig import Side


class E2VTrainConfig(BaseConfig):
    """Elements-to-Video training: the dataset config in the user's JSON (a file, or the same objects inline) plus
    the overrides that seed 001's command line sets. The datasets are validated by E2VConfig's loader, which names
    fields as the user wrote them."""

    dataset_config: PathText = Field("", description="a JSON file: {\"datasets\": [...]} in the nested or flat form")
    datasets: list[dict[str, Any]] = Field([], description="the same dataset objects inline")
    e2v_type: Literal["", "vae", "clip", "dual"] = Field("", description="overrides every dataset's e2v_type")
    frame_conditioning: Literal["", "full", "index", "prefix", "random", "first_and_last"] = ""
    frame_index: int | None = Field(None, ge=0, le=1024)
    concatenate_mask: bool | None = None
    as_vace_references: bool = Field(False, description="on a VACE model: each item's elements are its VACE "
                                                        "reference images (in slot order), no E2V condition")
    resolution: tuple[Side, Side] | None = Field(
        None, description="[height, width]: overrides every dataset's target_resolution and processors.vae.resolution")

    @property
    def enabled(self) -> bool:
        return bool(self.dataset_config or self.datasets)
