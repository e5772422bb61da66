"""The accelerator a LoRA's previews ran with, recorded in its safetensors header so that `sample` with the LoRA
stacks the same accelerator on the same schedule by default (docs/distilled.md)."""
import json
from pathlib import Path

from modules.util.config.AcceleratorConfig import AcceleratorConfig

ACCELERATOR_METADATA = "wan_accelerator"   # JSON: file, file_2 (absolute), strength, steps, timesteps, shift


def accelerator_metadata(train_config: dict) -> dict[str, str]:
    """{ACCELERATOR_METADATA: JSON} for a training config whose previews are accelerated, else {}."""
    section = (train_config.get("sampling") or {}).get("accelerator") or {}
    if not section.get("file"):
        return {}
    config = AcceleratorConfig(**section)
    # the config names files as given, often relative to where the run started: sampling the LoRA from elsewhere
    # needs them absolute
    record = dict(file=str(Path(config.file).resolve()),
                  file_2=str(Path(config.file_2).resolve()) if config.file_2 else "",
                  strength=config.strength, steps=len(config.timestep_list()), timesteps=config.timestep_list(),
                  shift=config.shift)
    return {ACCELERATOR_METADATA: json.dumps(record)}


def recorded_accelerator(path: str | Path) -> AcceleratorConfig | None:
    """The accelerator a LoRA file's header records (None when it records none or cannot be read)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(ACCELERATOR_METADATA)
        return AcceleratorConfig(**json.loads(text)) if text else None
    except Exception:  # noqa: BLE001 - a header we cannot read records nothing; loading the LoRA says why
        return None


def own_schedule(path: str | Path) -> AcceleratorConfig | None:
    """The schedule an accelerator file's own header says it was distilled for (a `wan_accelerator` record naming no
    file, as scripts/make_demo_accelerator.py writes), else None."""
    config = recorded_accelerator(path)
    return config if config is not None and not config.file else None
