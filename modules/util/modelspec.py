"""safetensors header metadata: modelspec (resources/sd_model_spec/) plus, optionally, the training config."""
import datetime
import json
from pathlib import Path

from modules.util.enum.WanVariant import WanVariant

SPEC_DIR = Path(__file__).resolve().parents[2] / "resources" / "sd_model_spec"

_SPEC_NAMES = {
    WanVariant.T2V: "wan_2_1-t2v", WanVariant.I2V: "wan_2_1-i2v", WanVariant.FLF2V: "wan_2_1-flf2v",
    WanVariant.TI2V_5B: "wan_2_2-ti2v_5b", WanVariant.T2V_A14B: "wan_2_2-t2v_a14b",
    WanVariant.I2V_A14B: "wan_2_2-i2v_a14b",
}

# Keys whose values never go into a file header, wherever they appear in the config.
_SECRET_KEYS = ("token", "secret", "password", "api_key")


def _without_secrets(value):
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items()
                if not any(s in k.lower() for s in _SECRET_KEYS)}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return value


def modelspec_metadata(variant: WanVariant, lora: bool = False, title: str | None = None,
                       train_config: dict | None = None) -> dict[str, str]:
    name = _SPEC_NAMES[variant] + ("-lora" if lora else "")
    metadata = json.loads((SPEC_DIR / f"{name}.json").read_text(encoding="utf-8"))
    metadata["modelspec.date"] = datetime.date.today().isoformat()
    if title:
        metadata["modelspec.title"] = title
    if train_config is not None:
        metadata["training_config"] = json.dumps(_without_secrets(train_config))
    return {k: str(v) for k, v in metadata.items()}
