"""Which model parts a file or folder holds, judged by tensor names and shapes (never by file names), with each
part's layout and dtype. Only headers are read (safetensors) or memory-mapped (.pth).

Folders: a diffusers pipeline folder (model_index.json) gives its subfolders; a diffusers part folder (config.json
beside the weights) gives that part; any other folder (an official Wan release, a ComfyUI models folder) is searched
by content, three levels deep, with the A14B experts told apart by the official `high_noise_model/` and
`low_noise_model/` folders.
"""
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from modules.modelLoader.wan.parts.tensor_files import (ModelFileError, TensorInfo, group_weight_files,
                                                        read_keys_and_shapes, shard_set)
from modules.modelLoader.wan.parts.transformer_files import TransformerFile, dtype_label, recognise_transformer
from modules.modelLoader.wan.parts.vae_files import VaeFile, recognise_vae

logger = logging.getLogger(__name__)

EXPERT_FOLDERS = {"high_noise_model": "transformer", "low_noise_model": "transformer_2"}
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")
SEARCH_DEPTH = 3
SEARCH_FOLDERS = 64   # a model folder has a handful (release: google/umt5-xxl, assets, examples; ComfyUI: models/*)
_DIFFUSERS_CLASSES = {"WanTransformer3DModel": "transformer", "WanVACETransformer3DModel": "transformer",
                      "WanAnimateTransformer3DModel": "transformer", "WanAnimate2Transformer3DModel": "transformer",
                      "AutoencoderKLWan": "vae",
                      "UMT5EncoderModel": "text_encoder", "T5EncoderModel": "text_encoder",
                      "CLIPVisionModel": "image_encoder", "CLIPVisionModelWithProjection": "image_encoder"}


@dataclass
class FoundPart:
    part: str                    # "transformer", "vae", "text_encoder", "image_encoder"
    files: list[Path]
    layout: str
    dtype: str
    detail: TransformerFile | VaeFile | None = None
    config: dict | None = None   # the config.json of a diffusers part folder, or one beside a single file
    folder: Path | None = None   # a diffusers part folder (loaded with from_pretrained)
    role: str | None = None      # "transformer" / "transformer_2" when the folder names the A14B expert
    keys: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        where = self.folder if self.folder is not None else self.files[0]
        shards = f" (+{len(self.files) - 1} shards)" if len(self.files) > 1 else ""
        return f"{where}{shards}: {self.layout}, {self.dtype}"


def dominant_dtype(keys: dict[str, TensorInfo]) -> str:
    """The dtype most weight elements are stored in; fp8_scaled when the file carries ComfyUI's scales."""
    from modules.modelLoader.wan.parts import comfy_quant
    if comfy_quant.has_scales(keys):
        return "fp8_scaled"
    counts: Counter[str] = Counter()
    for info in keys.values():
        if info.dtype.startswith(("float", "bfloat")):
            counts[info.dtype] += info.numel
    return dtype_label(counts.most_common(1)[0][0]) if counts else "unknown"


def _read_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelFileError(f"{path}: not valid JSON") from None
    return config if isinstance(config, dict) else None


def _beside_config(files: list[Path]) -> dict | None:
    """A config.json beside a single file (diffusers or official Wan format) describes it."""
    return _read_config(files[0].parent / "config.json")


def recognise_files(files: list[Path], keys: dict[str, TensorInfo] | None = None) -> list[FoundPart]:
    """The parts one file (or sharded set) holds: usually one, several in a checkpoint that bundles them (ComfyUI's
    save_checkpoint: the transformer under `model.diffusion_model.`, the VAE under `vae.`, the text encoder under
    `text_encoders.umt5xxl.transformer.`); empty when it holds no Wan model part."""
    keys = read_keys_and_shapes(files) if keys is None else keys
    parts = []
    if (transformer := recognise_transformer(keys)) is not None:
        parts.append(FoundPart("transformer", files, transformer.layout, transformer.dtype, transformer, keys=keys))
    if (vae := recognise_vae(keys)) is not None:
        parts.append(FoundPart("vae", files, vae.layout, vae.dtype, vae, keys=keys))
    from modules.modelLoader.wan.parts.text_encoder_files import text_encoder_keys
    if (text := text_encoder_keys(keys)) is not None:
        own = [*text.names.values(), *text.scales.values()]
        parts.append(FoundPart("text_encoder", files, text.layout, dominant_dtype({k: keys[k] for k in own}),
                               keys=keys))
    from modules.modelLoader.wan.parts.image_encoder_files import image_encoder_sources, recognise_image_encoder
    if (layout := recognise_image_encoder(keys)) is not None:
        own = {source.key for source in image_encoder_sources(keys, layout).values()}
        parts.append(FoundPart("image_encoder", files, layout, dominant_dtype({k: keys[k] for k in own}),
                               keys=keys))
    return parts


def _part_folder(folder: Path) -> FoundPart | None:
    """A diffusers / transformers part folder: config.json naming a known class, with safetensors weights."""
    config = _read_config(folder / "config.json")
    if config is None:
        return None
    classes = [config.get("_class_name")] + list(config.get("architectures") or [])
    part = next((_DIFFUSERS_CLASSES[c] for c in classes if c in _DIFFUSERS_CLASSES), None)
    if part is None:
        return None
    all_groups = group_weight_files(folder)
    groups = [g for g in all_groups if g[0].name.endswith(".safetensors")]
    if not groups and all_groups:
        return None   # .pth / .pt / .ckpt model parts: searched, read with the restricted loader
    if not groups:
        from modules.util.safetensors_only import NotSafetensorsError, refuse_pickled_folder
        try:
            refuse_pickled_folder(folder, "model part")
        except NotSafetensorsError as error:
            raise ModelFileError(str(error)) from None
        raise ModelFileError(f"{folder}: config.json names {part} but the folder holds no .safetensors weights")
    if len(groups) > 1:
        return None   # several weight files beside a config.json (a ComfyUI folder): searched file by file
    files = groups[0]
    if not files[0].name.startswith(("model", "diffusion_pytorch_model")):
        return None   # not the file name from_pretrained reads (clip_vision_h.safetensors beside a config): searched
    keys = read_keys_and_shapes(files)
    detail = recognise_transformer(keys) if part == "transformer" else recognise_vae(keys) if part == "vae" else None
    if part in ("transformer", "vae") and (detail is None or detail.layout != "diffusers"):
        return None   # a config.json beside files in another layout: the folder is searched, the config kept

    return FoundPart(part, files, "diffusers", dominant_dtype(keys), detail, config=config, folder=folder, keys=keys)


def is_tokenizer_folder(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def find_parts(path: str | Path) -> list[FoundPart]:
    """Every model part in a file or folder (a file that is no part raises ModelFileError naming it)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: does not exist")
    if not path.is_file() and not path.is_dir():  # /dev/null, a FIFO: reading would fail or block
        raise ModelFileError(f"{path}: not a regular file (a device, FIFO or socket) nor a folder")
    if path.is_file():
        files = shard_set(path)
        parts = recognise_files(files)
        if not parts:
            raise ModelFileError(f"{path}: holds no Wan model part (no transformer, VAE, UMT5 text encoder or CLIP "
                                 f"image encoder tensor names)")
        for found in parts:
            found.config = _beside_config(files) if found.part in ("transformer", "vae") else None
        return parts
    if (path / "model_index.json").is_file():
        parts = []
        for sub in sorted(p for p in path.iterdir() if p.is_dir()):
            found = _part_folder(sub)
            if found is not None:
                found.role = sub.name if sub.name in ("transformer", "transformer_2") else None
                parts.append(found)
        return parts
    found = _part_folder(path)
    if found is not None:
        return [found]
    return _search(path, SEARCH_DEPTH, role=EXPERT_FOLDERS.get(path.name), budget=[SEARCH_FOLDERS, path])


def _search(folder: Path, depth: int, role: str | None, budget: list) -> list[FoundPart]:
    budget[0] -= 1   # [folders left, the folder searched]: a mistyped base ("/", a home folder) fails fast
    if budget[0] < 0:
        raise ModelFileError(f"{budget[1]}: more than {SEARCH_FOLDERS} folders below it; name the model's own "
                             f"folder (or each part's file)")
    parts: list[FoundPart] = []
    for group in group_weight_files(folder):
        try:
            found_parts = recognise_files(group)
        except ModelFileError as error:
            if group[0].name.endswith(".safetensors"):
                raise   # a truncated or damaged safetensors file (or shard) is an error wherever it is
            # a .pth / .ckpt that is no dict of tensors (another tool's checkpoint, a refused pickle) is no model
            # part: searching a folder skips it, naming it; pointed at directly, it is an error
            logger.warning("skipped while searching %s: %s", folder, error)
            continue
        for found in found_parts:
            if found.part in ("transformer", "vae"):
                found.config = _beside_config(group)
            found.role = role if found.part == "transformer" else None
            parts.append(found)
    if depth > 1:
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            part_folder = _part_folder(sub)
            if part_folder is not None:
                part_folder.role = EXPERT_FOLDERS.get(sub.name, role) if part_folder.part == "transformer" else None
                parts.append(part_folder)
            else:
                parts += _search(sub, depth - 1, EXPERT_FOLDERS.get(sub.name, role), budget)
    return parts


def describe_part(path: str | Path) -> str:
    """What a path holds, for the GUI's model tab: one line per part found, or why not (reads headers only)."""
    if not str(path).strip():
        return "(from the base model)"
    try:
        parts = find_parts(path)
    except ModelFileError as error:
        return f"not usable: {error}"
    if not parts:
        return "no Wan model part found"
    return "; ".join(f"{found.part}: {found.layout}, {found.dtype}" +
                     (f" ({found.role})" if found.role == "transformer_2" else "") for found in parts)
