"""What an E2V LoRA or fine-tune carries so that it samples from the file alone: its element layout (the E2V
dataset config it trained with: element names, order, suffixes, reference frames per element, before/after, frame
conditioning, mask, processors and their resolutions) and where its image encoder came from. A LoRA holds both in
its safetensors header; a fine-tuned folder holds the layout in `e2v_config.json` (its image encoder is inside)."""
import json
from pathlib import Path

from modules.model.e2v_model import E2V_CONFIG_METADATA, e2v_config_metadata
from modules.util.atomic import atomic_write_text
from modules.util.config.image_encoder_source import base_has_image_encoder, looks_like_hub_id
from modules.util.config.ModelConfig import ModelConfig

E2V_IMAGE_ENCODER_METADATA = "e2v_image_encoder"
E2V_CONFIG_FILE = "e2v_config.json"
BASE_IMAGE_ENCODER = "base"   # the base model's own image encoder


def image_encoder_source(model, model_config: ModelConfig) -> str:
    """"base", an absolute folder, or a hub id; "" when the model has no image encoder (the VAE pathway only)."""
    if getattr(model, "image_encoder", None) is None:
        return ""
    path = model_config.image_encoder.path
    base = Path(model_config.base_model_name)
    if not path or (base.is_dir() and base_has_image_encoder(base)) or (not base.is_dir() and not path):
        return BASE_IMAGE_ENCODER
    return path if looks_like_hub_id(path) else str(Path(path).resolve())


def e2v_file_metadata(model, model_config: ModelConfig) -> dict[str, str]:
    """The header entries of an E2V model's LoRA file; {} for a model that is not E2V."""
    if getattr(model, "e2v_config", None) is None:
        return {}
    return {E2V_CONFIG_METADATA: e2v_config_metadata(model.e2v_config),
            E2V_IMAGE_ENCODER_METADATA: image_encoder_source(model, model_config)}


def write_e2v_folder_config(model, folder: str | Path) -> Path | None:
    """`e2v_config.json` in a saved model folder, in the form `--e2v-config` reads; None for a model that is not E2V."""
    if getattr(model, "e2v_config", None) is None:
        return None
    layout = json.loads(e2v_config_metadata(model.e2v_config))
    path = Path(folder) / E2V_CONFIG_FILE
    atomic_write_text(path, json.dumps({"datasets": [{**layout, "data_root": "."}]}, indent=2))
    return path
