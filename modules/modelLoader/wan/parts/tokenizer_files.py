"""Finds the UMT5 tokenizer where users keep it, reading nothing from the network unless allowed.

Looked for, in order:
1. `model.tokenizer.path` or the base model (`folder_or_file`): a tokenizer folder (tokenizer.json /
   tokenizer_config.json / spiece.model), a diffusers folder's `tokenizer/`, the official release's `google/umt5-xxl/`
   (searched a few levels down), a sentencepiece `.model` file, or a text-encoder file holding a `spiece_model`
   tensor;
2. the text-encoder files: a `spiece_model` tensor (ComfyUI stores the tokenizer's sentencepiece model in its
   text-encoder files as uint8 bytes: comfy/text_encoders/spiece_tokenizer.py `serialize_model`, read for Wan in
   comfy/sd.py), or a tokenizer folder beside them;
3. the hub (`hub_id`), only with `model.allow_download: true`.
A tokenizer built from a sentencepiece model has no `<extra_id_N>` sentinels (ComfyUI's SPieceTokenizer has none
either); every other id is the sentencepiece model's, with `</s>` appended as UMT5 does.
"""
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, T5Tokenizer

from modules.modelLoader.wan.parts.recognise import is_tokenizer_folder
from modules.modelLoader.wan.parts.tensor_files import (ModelFileError, SAFETENSORS_SUFFIX, open_tensors,
                                                        read_keys_and_shapes)
from modules.util.encoder_keys import SPIECE_MODEL_KEY

CONFIG_FILES = ("tokenizer.json", "tokenizer_config.json")
SENTENCEPIECE_FILE = "spiece.model"
# where the layouts keep the tokenizer, relative to the model folder
NAMED_FOLDERS = (Path("tokenizer"), Path("google") / "umt5-xxl")
SEARCH_DEPTH = 3


def _from_folder(folder: Path) -> PreTrainedTokenizerBase:
    try:
        if any((folder / name).is_file() for name in CONFIG_FILES):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return T5Tokenizer.from_pretrained(folder, extra_ids=0, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelFileError(f"{folder}: not a readable tokenizer folder ({str(error)[:300]})") from None


def _from_sentencepiece_bytes(model: bytes, origin: str) -> PreTrainedTokenizerBase:
    with tempfile.TemporaryDirectory(prefix="spiece-") as folder:
        (Path(folder) / SENTENCEPIECE_FILE).write_bytes(model)
        try:
            return T5Tokenizer.from_pretrained(folder, extra_ids=0, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as error:
            raise ModelFileError(f"{origin}: not a sentencepiece model ({str(error)[:300]})") from None


def _spiece_tensor(files: list[Path]) -> PreTrainedTokenizerBase | None:
    """The tokenizer stored as a `spiece_model` uint8 tensor in a safetensors text-encoder file, if any."""
    files = [f for f in files if f.name.endswith(SAFETENSORS_SUFFIX)]
    if not files:
        return None
    keys = read_keys_and_shapes(files)
    key = next((k for k in keys if k == SPIECE_MODEL_KEY or k.endswith("." + SPIECE_MODEL_KEY)), None)
    if key is None:
        return None
    if keys[key].dtype != "uint8" or len(keys[key].shape) != 1:
        raise ModelFileError(f"{files[0]}: {key!r} is {keys[key].dtype} {keys[key].shape}, not the uint8 bytes of "
                             f"a sentencepiece model")
    with open_tensors(files) as tensors:
        model = tensors[key].numpy().tobytes()
    return _from_sentencepiece_bytes(model, f"{files[0]} ({key})")


def _in_folder(folder: Path, depth: int = SEARCH_DEPTH) -> PreTrainedTokenizerBase | None:
    if is_tokenizer_folder(folder):
        return _from_folder(folder)
    for named in NAMED_FOLDERS:
        if is_tokenizer_folder(folder / named):
            return _from_folder(folder / named)
    if depth > 1:
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found = _in_folder(sub, depth - 1)
            if found is not None:
                return found
    return None


def _at(path: Path) -> PreTrainedTokenizerBase | None:
    if path.is_dir():
        return _in_folder(path)
    if path.name == SENTENCEPIECE_FILE or path.suffix == ".model":
        return _from_sentencepiece_bytes(path.read_bytes(), str(path))
    if path.name in CONFIG_FILES:
        return _from_folder(path.parent)
    if path.name.endswith(SAFETENSORS_SUFFIX):
        return _spiece_tensor([path])
    return None


def find_tokenizer(folder_or_file: Path | None, text_encoder_paths: list[Path], allow_download: bool,
                   hub_id: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer for a model given as files (see the module docstring for where it is looked for)."""
    looked: list[str] = []
    if folder_or_file is not None and str(folder_or_file).strip():
        path = Path(folder_or_file)
        if path.exists():
            found = _at(path)
            if found is not None:
                return found
            looked.append(str(path))
    text_encoder_paths = [Path(p) for p in text_encoder_paths]
    if text_encoder_paths:
        found = _spiece_tensor(text_encoder_paths)
        if found is not None:
            return found
        looked.append(f"{text_encoder_paths[0]} (no {SPIECE_MODEL_KEY!r} tensor)")
        beside = text_encoder_paths[0].parent
        for folder in (beside, *(beside / named for named in NAMED_FOLDERS), beside.parent / "tokenizer"):
            if is_tokenizer_folder(folder):
                return _from_folder(folder)
        looked.append(f"{beside} (no tokenizer folder beside the text encoder)")
    if allow_download and hub_id:
        return AutoTokenizer.from_pretrained(hub_id)
    download = (f"; or set model.allow_download: true to fetch {hub_id}" if hub_id and not allow_download else "")
    raise ModelFileError(f"no UMT5 tokenizer found (looked in: {'; '.join(looked) or 'nothing given'}): set "
                         f"model.tokenizer.path to a tokenizer folder (a diffusers folder's tokenizer/, the official "
                         f"release's google/umt5-xxl/), a sentencepiece spiece.model, or a ComfyUI umt5_xxl "
                         f"safetensors file holding a 'spiece_model' tensor{download}")
