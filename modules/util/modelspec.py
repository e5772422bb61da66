"""safetensors header metadata: modelspec (resources/sd_model_spec/) plus, optionally, the training config (and\nthe accelerator its previews ran with)."""
import datetime
import functools
import json
from pathlib import Path

from modules.util.accelerator_metadata import accelerator_metadata
from modules.util.enum.WanVariant import WanVariant

SPEC_DIR = Path(__file__).resolve().parents[2] / "resources" / "sd_model_spec"

_SPEC_NAMES = {
    WanVariant.T2V: "wan_2_1-t2v", WanVariant.I2V: "wan_2_1-i2v", WanVariant.FLF2V: "wan_2_1-flf2v",
    WanVariant.TI2V_5B: "wan_2_2-ti2v_5b", WanVariant.T2V_A14B: "wan_2_2-t2v_a14b",
    WanVariant.I2V_A14B: "wan_2_2-i2v_a14b",
    WanVariant.VACE: "wan_2_1-vace", WanVariant.VACE_A14B: "wan_2_2-vace_fun_a14b",
    WanVariant.FUN_CONTROL: "wan_2_1-fun_control", WanVariant.FUN_CONTROL_A14B: "wan_2_2-fun_control_a14b",
    WanVariant.FUN_INP: "wan_2_1-fun_inp",
    WanVariant.ANIMATE_14B: "wan_2_2-animate_14b", WanVariant.ANIMATE_2_14B: "wan_2_2-animate_2_14b",
}

BASE_MODEL_METADATA = "wan_base_model"   # the trained-on base folder, absolute

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
    metadata = dict(_spec(name))
    metadata["modelspec.date"] = datetime.date.today().isoformat()
    if title:
        metadata["modelspec.title"] = title
    if train_config is not None:
        metadata["training_config"] = json.dumps(_without_secrets(train_config))
        base = (train_config.get("model") or {}).get("base_model_name")
        if isinstance(base, str) and base and Path(base).is_dir():
            # the config names the base as given, often relative to the folder the run started in: sampling the
            # file from elsewhere needs the folder itself
            metadata[BASE_MODEL_METADATA] = str(Path(base).resolve())
        metadata.update(accelerator_metadata(train_config))
    return {k: str(v) for k, v in metadata.items()}


# ---- which model a file is for ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _spec(name: str) -> dict:
    """Read once per process; callers copy before changing it."""
    return json.loads((SPEC_DIR / f"{name}.json").read_text(encoding="utf-8"))


def architecture(variant: WanVariant) -> str:
    """The modelspec architecture of a variant's models, e.g. `wan_2_1_t2v` (its LoRAs add `/lora`)."""
    return _spec(_SPEC_NAMES[variant])["modelspec.architecture"]


def describe_architecture(arch: str) -> str:
    """`wan_2_1_t2v/lora` -> `wan_2_1_t2v (Wan 2.1 T2V)`; an architecture we do not know is named as it is."""
    base = arch.split("/")[0]
    for variant, name in _SPEC_NAMES.items():
        if architecture(variant) == base:
            return f"{base} ({_spec(name)['modelspec.title']})"
    return base


def file_architecture(path: str | Path) -> str | None:
    """`modelspec.architecture` from a safetensors header (None when absent or unreadable); reads the header only."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("modelspec.architecture")
    except Exception:  # noqa: BLE001 - a file we cannot read has no architecture to compare; loading it says why
        return None


def trained_base_model(path: str | Path) -> str | None:
    """The base a file's header records: the folder it was trained on where that still exists, else the training
    config's `model.base_model_name` as given (a hub id, or a path relative to where the run started); None when
    the header names none."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        config = json.loads(metadata.get("training_config", "null"))
    except Exception:  # noqa: BLE001 - an unreadable file names no base; loading it says why
        return None
    folder = metadata.get(BASE_MODEL_METADATA)
    if folder and Path(folder).is_dir():
        return folder
    base = (config.get("model") or {}).get("base_model_name") if isinstance(config, dict) else None
    return base if isinstance(base, str) and base else None


def missing_recorded_base(base: str, source) -> str | None:
    """Why the base a file's header (or a backup) records cannot be used here: not a folder here and not a hub id
    (a path relative to where the run started, a folder moved since); None when it can."""
    from modules.util.config.image_encoder_source import looks_like_hub_id
    if Path(base).is_dir() or looks_like_hub_id(base):
        return None
    return (f"the base model {base!r} that {source} records is not a folder here (a relative path is read from "
            f"where the run started): name the base with --base-model-name")


def lora_model_mismatch(path: str | Path, variant: WanVariant) -> str | None:
    """A sentence naming both models when the LoRA's header says it was made for another variant; None when it
    matches or says nothing."""
    arch = file_architecture(path)
    if not arch or arch.split("/")[0] == architecture(variant):
        return None
    return (f"the LoRA {path} was made for {describe_architecture(arch)}, but the model is {variant}, "
            f"{describe_architecture(architecture(variant))}")


# control models that take their control by different routes: a LoRA of one moves weights the other does not have or
# uses otherwise (VACE: separate VACE blocks fed a control context; Wan-Fun Control: control latents in the input
# channels of the base blocks)
_CONTROL_FAMILIES = {"vace": "VACE (control through its VACE blocks)",
                     "fun_control": "Wan-Fun Control (control latents in the input channels)"}


def _control_family(arch: str) -> str | None:
    base = arch.split("/")[0]
    return next((family for family in _CONTROL_FAMILIES if family in base), None)


def control_lora_refusal(path: str | Path, variant: WanVariant) -> str | None:
    """A sentence refusing a VACE LoRA on a Wan-Fun Control model or the reverse (read from the LoRA's header);
    None otherwise."""
    arch = file_architecture(path)
    if not arch:
        return None
    theirs, ours = _control_family(arch), _control_family(architecture(variant))
    if theirs is None or ours is None or theirs == ours:
        return None
    return (f"the LoRA {path} was made for {describe_architecture(arch)}, a {_CONTROL_FAMILIES[theirs]} model, but "
            f"the model is {variant}, {describe_architecture(architecture(variant))}, a {_CONTROL_FAMILIES[ours]} "
            f"model: the two take their control by different routes, so the LoRA does not fit; use it with the "
            f"model it was trained on")


def animate_lora_refusal(path: str | Path, variant: WanVariant) -> str | None:
    """Why a LoRA must not be applied to `variant`: made for Wan2.2-Animate and given another model, or the other way
    round (Animate's blocks take other conditions, a pose, a face, a reference frame, than any other model's). None
    otherwise; other mismatches are the caller's to note."""
    mismatch = lora_model_mismatch(path, variant)
    if mismatch and (variant.is_animate or "animate" in (file_architecture(path) or "")):
        return f"{mismatch}: an Animate LoRA works only on its Animate model, and the other way round"
    return None


def lora_family_refusal(path: str | Path, variant: WanVariant) -> str | None:
    """Why a LoRA must not be applied to `variant` at all (not merely a poor fit): made for another control family
    (VACE / Wan-Fun Control) or for Wan2.2-Animate on another model, or the other way round. None otherwise."""
    return control_lora_refusal(path, variant) or animate_lora_refusal(path, variant)


def lora_shape_message(path: str | Path, variant: WanVariant, error: Exception) -> str:
    """A LoRA whose tensors do not fit the model: the error, with the LoRA's and the model's architectures."""
    arch = file_architecture(path)
    made_for = describe_architecture(arch) if arch else "an unknown model (no modelspec.architecture in its header)"
    return (f"the LoRA {path} does not fit the model: {error}. The LoRA was made for {made_for}; the model is "
            f"{variant}, {describe_architecture(architecture(variant))} (a LoRA fits only the architecture and size "
            f"it was trained on, e.g. not a 1.3B LoRA on a 14B model)")
