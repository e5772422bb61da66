"""Where E2V's CLIP pathway gets its image encoder: the base's own (a Wan 2.1 I2V / FLF2V folder), the one
`model.image_encoder.path` names (`train --image_encoder PATH_OR_HUB_ID`), or, for a base named by hub id (downloads
implied), Wan 2.1 I2V's: the CLIP ViT-H/14 vision tower that SkyReels-A2 uses as well. Decided before any model
loads; a local base without one and no path is a config error naming the flag and what it takes."""
import json
import logging
from pathlib import Path

from modules.util.config.TrainConfig import TrainConfig

log = logging.getLogger(__name__)

# its image_encoder/ and image_processor/ subfolders: CLIP ViT-H/14 (open-clip xlm-roberta-large-vit-huge-14's
# vision tower), the image encoder of every Wan 2.1 I2V / FLF2V model
WAN_I2V_IMAGE_ENCODER = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"

WHAT_WORKS = ("a diffusers folder with image_encoder/ and image_processor/ (a Wan 2.1 I2V or FLF2V folder), a CLIP "
              "vision model folder (config.json, model.safetensors, preprocessor_config.json), a single file "
              "(ComfyUI's clip_vision_h.safetensors, the official CLIP .pth), or, with model.allow_download, a hub "
              f"id such as {WAN_I2V_IMAGE_ENCODER}")


def looks_like_hub_id(text: str) -> bool:
    """`owner/name` and nothing that exists here: how the loaders tell a hub id from a local path."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not Path(text).exists() and not text.startswith((".", "~"))


def base_has_image_encoder(base: Path) -> bool:
    index = base / "model_index.json"
    try:
        entry = json.loads(index.read_text(encoding="utf-8")).get("image_encoder")
    except (OSError, ValueError):
        return False
    return bool(entry) and entry[0] is not None


def resolve_image_encoder(config: TrainConfig, uses_clip: bool, e2v_type: str) -> list[str]:
    """Sets `model.image_encoder.path` to Wan 2.1 I2V's for a hub-id base (with a notice); returns the problems
    (a local base without an image encoder and no path given)."""
    if not uses_clip or config.model.image_encoder.path:
        return []
    base = Path(config.model.base_model_name)
    if base.is_dir():
        if base_has_image_encoder(base) or not (base / "model_index.json").is_file():
            # a folder of single files (ComfyUI, an official release): its parts are found by content when it
            # loads, a CLIP file among them included
            return []
        return [f"model.image_encoder.path: e2v_type {e2v_type!r} uses the CLIP pathway, but {str(base)!r} has no "
                f"image_encoder; name one with --image_encoder PATH_OR_HUB_ID (model.image_encoder.path): "
                f"{WHAT_WORKS}"]
    if config.model.allow_download and looks_like_hub_id(config.model.base_model_name):
        # a hub base that has its own (an I2V id) keeps it: the loader prefers the base's image encoder
        config.model.image_encoder.path = WAN_I2V_IMAGE_ENCODER
        log.warning("notice: e2v_type %r uses the CLIP pathway: the image encoder comes from %s (Wan 2.1 I2V's "
                    "CLIP ViT-H/14, as SkyReels-A2 uses) unless the base %s has its own; --image_encoder names "
                    "another", e2v_type, WAN_I2V_IMAGE_ENCODER, config.model.base_model_name)
    return []


def image_encoder_description(config: TrainConfig, model) -> str | None:
    """The plan's line on the image encoder (None when the model has none)."""
    if getattr(model, "image_encoder", None) is None:
        return None
    path = config.model.image_encoder.path
    base = Path(config.model.base_model_name)
    if not path or (base.is_dir() and base_has_image_encoder(base)):
        return f"image encoder: the base's own ({config.model.base_model_name})"
    if path == WAN_I2V_IMAGE_ENCODER:
        return (f"image encoder: {path} (the default for a hub-id base: Wan 2.1 I2V's CLIP ViT-H/14, as "
                f"SkyReels-A2 uses; --image_encoder names another)")
    return f"image encoder: {path} (model.image_encoder.path)"
