"""A step-distilled base model (lightx2v's Wan2.1-Distill-Models / Wan2.2-Distill-Models, bf16 and fp8 single files,
or a LightX2V model folder): its tensors are named and shaped as the base's, so what says it is distilled is around
them, looked at in this order:

1. a LightX2V config: a JSON file beside the weights (LightX2V merges a model folder's `config.json`; its run
   configs, configs/distill/*.json, are kept beside downloads) holding `denoising_step_list`, `enable_cfg` false,
   and `sample_shift`;
2. the safetensors header: a `config` entry (JSON) holding the same keys (LightX2V reads a checkpoint's config from
   that entry, lightx2v/utils/set_config.py);
A file with neither is an ordinary base, whatever its name (files are judged by content): lightx2v's published single
files carry no such header, so put the LightX2V config they run with (configs/distill/wan21/*_4step_cfg.json,
configs/distill/wan22/*.json) beside them.

Such a base is sampled on its own schedule by default: LightX2V's step-distill schedule (modules/modelSampler/
accelerator.py) with no accelerator file, guidance 1, no negative pass.
"""
import json
from dataclasses import dataclass
from pathlib import Path

from modules.util.config.AcceleratorConfig import LIGHTX2V_SHIFT, AcceleratorConfig

_SEARCH = ("", "transformer", "high_noise_model")   # where a folder's weights and config sit


@dataclass
class DistilledBase:
    source: str              # what says it is distilled, for the printed line
    timesteps: list[int]
    shift: float

    def schedule(self) -> AcceleratorConfig:
        return AcceleratorConfig(steps=len(self.timesteps), timesteps=self.timesteps, shift=self.shift)

    def describe(self) -> str:
        return (f"a step-distilled model ({self.source}): sampling on its schedule, {len(self.timesteps)} steps, "
                f"timesteps {self.timesteps}, shift {self.shift:g}, guidance 1, no negative prompt pass")


def _from_config(config: dict, source: str) -> DistilledBase | None:
    steps = config.get("denoising_step_list")
    if not isinstance(steps, list) or not steps or config.get("enable_cfg", False):
        return None
    try:
        timesteps = [int(t) for t in steps]
        AcceleratorConfig(timesteps=timesteps, shift=float(config.get("sample_shift", LIGHTX2V_SHIFT)))
    except (TypeError, ValueError):   # pydantic's ValidationError is a ValueError
        return None
    return DistilledBase(source, timesteps, float(config.get("sample_shift", LIGHTX2V_SHIFT)))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _header_config(path: Path) -> dict:
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as handle:
            text = (handle.metadata() or {}).get("config")
        data = json.loads(text) if text else {}
    except (OSError, ValueError):   # safetensors raises SafetensorError (an OSError subclass) or ValueError
        return {}
    return data if isinstance(data, dict) else {}


def distilled_base(base_model_name: str | Path) -> DistilledBase | None:
    """What says `base_model_name` (a file or folder) is a step-distilled model and its schedule; None for a base."""
    path = Path(base_model_name)
    if path.is_file():
        folders, weights = [path.parent], [path]
    elif path.is_dir():
        folders = [path / sub for sub in _SEARCH if (path / sub).is_dir()]
        weights = sorted(file for folder in folders for file in folder.glob("*.safetensors"))
    else:
        return None
    for folder in folders:
        for config_path in sorted(folder.glob("*.json")):
            found = _from_config(_read_json(config_path), f"{config_path.name} lists its denoising_step_list")
            if found is not None:
                return found
    for file in weights:
        found = _from_config(_header_config(file), f"the header of {file.name} lists its denoising_step_list")
        if found is not None:
            return found
    return None
