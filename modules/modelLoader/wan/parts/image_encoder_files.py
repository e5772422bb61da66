"""The CLIP ViT-H/14 image encoder (Wan 2.1 I2V / FLF2V) in the layouts users hold it, loaded into transformers'
`CLIPVisionModel` with its `CLIPImageProcessor`.

Layouts (recognised by tensor names; the name maps and their sources are in modules/util/encoder_keys.py):
- "wan": the official `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (Wan-Video/Wan2.1
  `wan/modules/clip.py` names: `visual.transformer.N.attn.to_qkv`, ...); its `textual.` tower is ignored.
- "open_clip": an open_clip ViT checkpoint (`visual.conv1`, `visual.transformer.resblocks.N.attn.in_proj_weight`).
- "comfyui": transformers' names (`vision_model.*`, maybe `visual_projection.weight`), as ComfyUI's
  `clip_vision_h.safetensors` and a diffusers folder's `image_encoder/` hold them.
Wan conditions on the penultimate layer (`hidden_states[-2]`, the official code's `use_31_block=True`): the
projection head is not needed and not loaded.

The head count is not in any tensor shape: it comes from `config` (a CLIPVisionConfig dict) when given, a CLIP
config.json beside the file, or the released ViT-H/14 (resources/wan_configs/encoders/) for a 1280-wide tower.
"""
import json
import math
import re
from pathlib import Path

import torch
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from modules.modelLoader.wan.parts.state_reads import TensorRead, read_state
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo, open_tensors, read_keys_and_shapes
from modules.modelLoader.wan.parts.text_encoder_files import shape_mismatch
from modules.util.empty_weights import empty_weights
from modules.util.encoder_keys import ClipSource, clip_vision_sources

LAYOUT_WAN = "wan"
LAYOUT_OPEN_CLIP = "open_clip"
LAYOUT_COMFYUI = "comfyui"
CONFIG_DIR = Path(__file__).resolve().parents[4] / "resources" / "wan_configs" / "encoders"
VIT_H_WIDTH = 1280

_ANCHORS = {
    LAYOUT_WAN: re.compile(r"^(?P<outer>.*?)visual\.transformer\.0\.attn\.to_qkv\.weight$"),
    LAYOUT_OPEN_CLIP: re.compile(r"^(?P<outer>.*?)visual\.transformer\.resblocks\.0\.attn\.in_proj_weight$"),
    LAYOUT_COMFYUI: re.compile(r"^(?P<outer>.*?)vision_model\.encoder\.layers\.0\.self_attn\.q_proj\.weight$"),
}
# transformers names of tensors that files may carry but CLIPVisionModel does not load
_NOT_LOADED = ("embeddings.position_ids",)


def _anchor(keys: dict[str, TensorInfo]) -> tuple[str, str] | None:
    for layout, pattern in _ANCHORS.items():
        match = next((m for key in keys if (m := pattern.match(key))), None)
        if match is not None:
            return layout, match["outer"]
    return None


def recognise_image_encoder(keys: dict[str, TensorInfo]) -> str | None:
    """"wan" (official CLIP .pth), "open_clip" or "comfyui" (transformers names), or None: no CLIP vision tower."""
    found = _anchor(keys)
    return found[0] if found is not None else None


def image_encoder_sources(keys: dict[str, TensorInfo], layout: str) -> dict[str, ClipSource]:
    """transformers CLIPVisionModel name -> where it is in the file."""
    found = _anchor(keys)
    if found is None or found[0] != layout:
        return {}
    outer = found[1]
    if layout == LAYOUT_COMFYUI:
        prefix = f"{outer}vision_model."
        sources = {key[len(prefix):]: ClipSource(key) for key in keys if key.startswith(prefix)}
    else:
        sources = clip_vision_sources(keys, layout, prefix=f"{outer}visual.")
    return {name: source for name, source in sources.items() if name not in _NOT_LOADED}


def _shape(source: ClipSource, info: TensorInfo) -> tuple[int, ...]:
    shape = info.shape
    if source.chunk is not None:
        shape = (shape[0] // 3, *shape[1:])
    if source.ndim is not None:
        shape = shape[-source.ndim:]
    return tuple(shape)


def _beside_config(path: Path) -> dict | None:
    """A transformers CLIP config.json beside the file (a CLIPVisionConfig, or a CLIPConfig's vision part)."""
    candidate = path.parent / "config.json"
    if not candidate.is_file():
        return None
    try:
        config = json.loads(candidate.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None   # another part's config (e.g. the official transformer's) is not this file's business
    if not isinstance(config, dict):
        return None
    if config.get("model_type") == "clip" and isinstance(config.get("vision_config"), dict):
        return config["vision_config"]
    return config if config.get("model_type") == "clip_vision_model" else None


def image_encoder_config(shapes: dict[str, tuple[int, ...]], source: str, given: dict | None = None) -> dict:
    """The CLIPVisionConfig of a vision tower: sizes from the shapes, the head count from `given` or the released
    ViT-H/14."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ModelFileError(f"{source}: no tensor for the CLIP vision tower's {name}")
        return shapes[name]

    width, channels, patch, _ = shape("embeddings.patch_embedding.weight")
    positions = shape("embeddings.position_embedding.weight")[0]
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1:
        raise ModelFileError(f"{source}: {positions} position embeddings are not a square grid plus a class token")
    layers = 1 + max(int(m[1]) for name in shapes if (m := re.match(r"^encoder\.layers\.(\d+)\.", name)))
    # what `given` leaves out is ViT-H/14's (GELU, eps 1e-5), not transformers' CLIP defaults (quick_gelu)
    config = json.loads((CONFIG_DIR / "clip-vit-h-14.json").read_text(encoding="utf-8"))
    if given is not None:
        config.update(given)
    elif width != VIT_H_WIDTH:
        raise ModelFileError(f"{source}: a CLIP vision tower {width} wide is not Wan's ViT-H/14 (1280) and its head "
                             f"count is in no tensor: put its transformers config.json (CLIPVisionConfig) beside "
                             f"the file")
    config.update(hidden_size=width, num_channels=channels, patch_size=patch, image_size=grid * patch,
                  intermediate_size=shape("encoder.layers.0.mlp.fc1.weight")[0], num_hidden_layers=layers)
    config.pop("architectures", None)
    return config


def processor_folder_near(path: Path) -> Path | None:
    """Where a CLIP vision model's preprocessor_config.json is: in its own folder, or, for a diffusers model's
    image_encoder/ (the folder or a file in it), in the image_processor/ beside it; or in a whole diffusers model
    folder's image_processor/. None when there is none."""
    folder = path if path.is_dir() else path.parent
    for candidate in (folder, folder.parent / "image_processor", folder / "image_processor"):
        if (candidate / "preprocessor_config.json").is_file():
            return candidate
    return None


def wan_clip_processor(image_size: int) -> CLIPImageProcessor:
    """Wan's own CLIP preprocessing (Wan-Video/Wan2.1 `wan/modules/clip.py` `CLIPModel.visual`): the whole picture
    resized to image_size x image_size, bicubic, no crop, then the OpenAI CLIP mean / std
    (resources/wan_configs/encoders/clip-vit-h-14-wan-preprocessor.json)."""
    settings = json.loads((CONFIG_DIR / "clip-vit-h-14-wan-preprocessor.json").read_text(encoding="utf-8"))
    settings.pop("image_processor_type", None)
    settings.update(size={"height": image_size, "width": image_size},
                    crop_size={"height": image_size, "width": image_size})
    return CLIPImageProcessor(**settings)


def image_processor_for(image_size: int, path: Path) -> CLIPImageProcessor:
    """The preprocessor saved with the model (`processor_folder_near`), else Wan's own CLIP preprocessing."""
    folder = processor_folder_near(Path(path))
    if folder is not None:
        return CLIPImageProcessor.from_pretrained(folder, local_files_only=True)
    return wan_clip_processor(image_size)


def plan_image_encoder(keys: dict[str, TensorInfo], layout: str, source: str, config: dict | None
                       ) -> tuple[dict[str, ClipSource], dict]:
    """Where each CLIPVisionModel tensor is in the file and the tower's config, every tensor checked against a
    meta-built model: from the header alone, before any weight is read."""
    sources = image_encoder_sources(keys, layout)
    if not sources:
        raise ModelFileError(f"{source}: not a CLIP vision tower in the {layout!r} layout")
    shapes = {name: _shape(src, keys[src.key]) for name, src in sources.items()}
    settings = image_encoder_config(shapes, source, config)
    with empty_weights():
        model = CLIPVisionModel(CLIPVisionConfig(**settings))
    problem = shape_mismatch({name: tuple(p.shape) for name, p in model.state_dict().items()}, shapes)
    if problem:
        raise ModelFileError(f"{source}: the tensors do not make a CLIP vision tower: {problem}")
    return sources, settings


def load_image_encoder(paths: list[Path], layout: str, dtype: torch.dtype, config: dict | None = None
                       ) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """CLIPVisionModel in `dtype` (meta-built, filled one tensor at a time by state_reads.py) and its processor.
    `config`: a CLIPVisionConfig dict for a tower whose head count is not the released ViT-H/14's."""
    paths = [Path(p) for p in paths]
    keys = read_keys_and_shapes(paths)
    sources, settings = plan_image_encoder(keys, layout, str(paths[0]), config or _beside_config(paths[0]))
    with empty_weights():
        model = CLIPVisionModel(CLIPVisionConfig(**settings))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    reads = {}
    for name, src in sources.items():
        reshaped = src.chunk is not None or src.ndim is not None
        take = (lambda tensor, _, src=src: src.take(tensor)) if reshaped else None
        reads[name] = TensorRead(src.key, shapes[name], dtype, keys[src.key].dtype, take)
    with open_tensors(paths) as tensors:
        state = read_state(tensors, reads)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), image_processor_for(settings["image_size"], paths[0])


def load_image_encoder_folder(folder: Path, dtype: torch.dtype) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """A transformers CLIP vision folder (config.json + safetensors: a diffusers model's image_encoder/, a CLIP
    repository) or a diffusers model folder holding one in image_encoder/, with its processor
    (`image_processor_for`)."""
    from modules.util.safetensors_only import NotSafetensorsError, refuse_pickled_folder
    folder = Path(folder)
    model_folder = folder / "image_encoder" if (folder / "image_encoder" / "config.json").is_file() else folder
    try:
        refuse_pickled_folder(model_folder, "model.image_encoder.path")
    except NotSafetensorsError as error:
        raise ModelFileError(str(error)) from None
    encoder = CLIPVisionModel.from_pretrained(model_folder, torch_dtype=dtype, local_files_only=True,
                                              use_safetensors=True)
    return encoder, image_processor_for(encoder.config.image_size, model_folder)
