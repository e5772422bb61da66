"""Makes a diffusers folder written under transformers 5 load under transformers 4 (and diffusers releases built on
it) as well, as the released Wan repositories do:

- model_index.json names `T5TokenizerFast` and `CLIPImageProcessor`: transformers 5 without torchvision records
  `T5Tokenizer` (T5TokenizerFast is an alias of it there; in 4.x it is the slow, sentencepiece tokenizer, which
  needs a spiece.model the folder does not have) and `CLIPImageProcessorPil` (a class 4.x does not have);
- the CLIP vision weights carry the `vision_model.` prefix: 4.x's CLIPVisionModel holds its layers under
  `vision_model` and reads only those names, while 5.x writes them without the prefix (and reads both);
- tokenizer_config.json holds no list under `extra_special_tokens` (4.x calls `.keys()` on it: an empty list is
  dropped, a non-empty one becomes `additional_special_tokens`, which both read) and none of the loading-time
  entries 5.x leaves there (`is_local`, `local_files_only`). tokenizer.json is what both versions' fast tokenizer
  reads.

Each step rewrites one file in place (the caller writes into a temporary folder that is renamed as a whole)."""
import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

CLIP_VISION_PREFIX = "vision_model."
_LOADING_ENTRIES = ("is_local", "local_files_only")


def patch_model_index(folder: Path) -> None:
    path = folder / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("tokenizer", [None])[0] == "transformers":
        index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    if index.get("image_processor", [None])[0] == "transformers":
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def patch_tokenizer_config(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOADING_ENTRIES:
        config.pop(key, None)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        del config["extra_special_tokens"]
        if extra:
            config.setdefault("additional_special_tokens", extra)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def prefix_clip_vision_weights(folder: Path) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file() or json.loads(config_path.read_text()).get("architectures") != ["CLIPVisionModel"]:
        return
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {"format": "pt"}
            tensors = {key if key.startswith(CLIP_VISION_PREFIX) else CLIP_VISION_PREFIX + key: file.get_tensor(key)
                       for key in file.keys()}
        save_file(tensors, str(path), metadata)
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {(k if k.startswith(CLIP_VISION_PREFIX) else CLIP_VISION_PREFIX + k): v
                               for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def make_portable(folder: Path) -> None:
    """All of the above on a written diffusers folder."""
    patch_model_index(folder)
    patch_tokenizer_config(folder / "tokenizer")
    prefix_clip_vision_weights(folder / "image_encoder")
