"""Toolkit-free controller of the model tab's part pickers: what each chosen file or folder holds (part, layout,
dtype), read from tensor headers before Start, and the variant of the model the tab describes."""
from pathlib import Path

from modules.ui.UIState import UIState

PICKER_PARTS = ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder", "tokenizer")


def describe_part(path: str) -> str:
    """One line: what `path` holds, or why it cannot be used (never raises for a bad path)."""
    from modules.modelLoader.wan.parts.recognise import describe_part as describe, is_tokenizer_folder
    path = (path or "").strip()
    if path and Path(path).is_dir() and is_tokenizer_folder(Path(path)):
        return "tokenizer folder"
    return describe(path)


def field_of(part: str) -> str:
    """The config field a picker sets: `model.base_model_name` for "base", else `model.<part>.path`."""
    return "model.base_model_name" if part == "base" else f"model.{part}.path"


def describe_model_part(state: UIState, part: str) -> str:
    """The line shown beside a part's path ("base": the parts the base model holds)."""
    return describe_for(part, state.get(field_of(part)) or "")


def describe_for(part: str, path: str) -> str:
    """`describe_model_part` for a path already read from the state (safe to run in a worker thread)."""
    if part == "base" and not (path and Path(path).exists()):
        return ""
    if not path:
        return "(from the base model)"
    from modules.util.config.image_encoder_source import looks_like_hub_id
    if part == "image_encoder" and looks_like_hub_id(path.strip()):
        return "hub id: fetched when the run starts (needs model.allow_download)"
    try:
        line = describe_part(path)
    except OSError as error:   # unreadable (permissions, a vanished network drive): said, not raised
        return f"not usable: {path}: {error.strerror or error}"
    return _only_the_part(part, line)


def _only_the_part(part: str, line: str) -> str:
    """A part picker names the part it takes from a folder of several (a whole diffusers model folder named as the
    image encoder), as the loader takes it; a path holding none of that part says so."""
    kind = "transformer" if part.startswith("transformer") else part
    entries = line.split("; ")
    if part in ("base", "tokenizer") or line.startswith("not usable") or len(entries) == 1 and ":" not in line:
        return line
    own = [entry for entry in entries if entry.startswith(f"{kind}:")]
    if not own:
        return f"not usable: holds {', '.join(entry.split(':')[0] for entry in entries)}, not {kind.replace('_', ' ')}"
    return "; ".join(own)


def model_config_from_state(state: UIState):
    from modules.util.config.ModelConfig import ModelConfig
    return ModelConfig.model_validate(state.get("model") or {})


def detect_variant_text(state: UIState) -> str | None:
    """The variant of a model given as files (an official release or ComfyUI folder, or part overrides), or None
    when the base is a plain diffusers folder (the caller's own detection applies)."""
    from modules.modelLoader.wan.parts.model_plan import uses_parts_loader
    from modules.modelLoader.wan.parts.model_plan import plan_model
    from modules.modelLoader.wan.parts.tensor_files import ModelFileError
    try:
        config = model_config_from_state(state)
    except ValueError as error:
        return f"config problem: {str(error).splitlines()[0]}"
    if not uses_parts_loader(config):
        return None
    try:
        plan = plan_model(config)
    except ModelFileError as error:
        return f"not a Wan model: {error}"
    from modules.ui.variant_text import variant_name
    return f"{variant_name(plan.variant)}, from files"


def detected_variant(state: UIState):
    """The chosen model's WanVariant (configs and tensor headers, no weights), or None when it cannot be told."""
    from modules.modelLoader.wan.parts.model_plan import detect_model_variant, uses_parts_loader
    from modules.util.wan_detection import NotAWanModelError
    try:
        config = model_config_from_state(state)
        if not (uses_parts_loader(config) or Path(config.base_model_name or "").is_dir()):
            return None
        return detect_model_variant(config)
    except (NotAWanModelError, ValueError, OSError):
        return None


def intended_variant(state: UIState):
    """The config's `model.intended_variant` as a WanVariant (None: any model, or not a variant's name)."""
    from modules.util.enum.WanVariant import WanVariant
    value = state.get("model.intended_variant")
    try:
        return WanVariant(value) if value else None
    except ValueError:
        return None
