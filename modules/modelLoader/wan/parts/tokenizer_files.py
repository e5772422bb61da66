"""Finds the UMT5 tokenizer where users keep it, reading nothing from the network unless allowed.

Looked for, in order:
1. `model.tokenizer.path` or the base model (`folder_or_file`): a tokenizer folder (tokenizer.json /
   tokenizer_config.json / spiece.model), a diffusers folder's `tokenizer/`, the official release's
   `google/umt5-xxl/`, a sentencepiece `.model` file, or a text-encoder file holding a `spiece_model` tensor;
2. the text-encoder files: a `spiece_model` tensor (ComfyUI stores the tokenizer's sentencepiece model in its
   text-encoder files as uint8 bytes: comfy/text_encoders/spiece_tokenizer.py `serialize_model`, read for Wan in
   comfy/sd.py), a safetensors file beside them holding only that tensor (ComfyUI's CLIPSave node,
   comfy_extras/nodes_model_merging.py, writes the encoder's weights to `<name>_umt5xxl_NNNNN_.safetensors` and
   the tokenizer's `spiece_model`, which has no `umt5xxl.` prefix, to `<name>_NNNNN_.safetensors`), or a tokenizer
   folder beside them (or beside their folder);
3. `tokenizer/`, `google/umt5-xxl/` or a `*umt5*` tokenizer folder up to three levels down the base folder;
4. the hub (`hub_id`), only with `model.allow_download: true`.
A tokenizer whose size does not fill the text encoder's embedding (UMT5: 256300 pieces for 256384 rows) is another
model's (T5's has 32100) and is refused, naming both.
A tokenizer built from a sentencepiece model has no `<extra_id_N>` sentinels (ComfyUI's SPieceTokenizer has none
either); every other id is the sentencepiece model's, with `</s>` appended as UMT5 does.
"""
import tempfile
from collections.abc import Iterator
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
            tokenizer = T5Tokenizer.from_pretrained(folder, extra_ids=0, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as error:
            raise ModelFileError(f"{origin}: not a sentencepiece model ({str(error)[:300]})") from None
    tokenizer.name_or_path = origin   # messages name the file, not the deleted temporary folder
    return tokenizer


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


def _spiece_files_beside(text_encoder_paths: list[Path]) -> Iterator[Path]:
    """Safetensors files beside the text encoder that hold a `spiece_model` tensor and nothing else (CLIPSave's)."""
    for candidate in sorted(text_encoder_paths[0].parent.glob(f"*{SAFETENSORS_SUFFIX}")):
        if candidate in text_encoder_paths:
            continue
        try:
            keys = read_keys_and_shapes([candidate])
        except ModelFileError:
            continue   # a damaged file beside it is not the tokenizer's business here
        if set(keys) == {SPIECE_MODEL_KEY}:
            yield candidate


def _named_in(folder: Path) -> PreTrainedTokenizerBase | None:
    """The folder itself when it is a tokenizer folder, else one of the layouts' named tokenizer folders in it."""
    for candidate in (folder, *(folder / named for named in NAMED_FOLDERS)):
        if is_tokenizer_folder(candidate):
            return _from_folder(candidate)
    return None


def _search(folder: Path, depth: int = SEARCH_DEPTH) -> Iterator[Path]:
    """Named tokenizer folders (tokenizer/, google/umt5-xxl/, or any tokenizer folder named *umt5*) a few levels
    down, nearest first: a models folder holds other models' tokenizers too, so no arbitrary folder is offered."""
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    for sub in subs:
        for candidate in (*(sub / named for named in NAMED_FOLDERS), sub if "umt5" in sub.name.lower() else None):
            if candidate is not None and is_tokenizer_folder(candidate):
                yield candidate
    if depth > 1:
        for sub in subs:
            yield from _search(sub, depth - 1)


def _from_file(path: Path) -> PreTrainedTokenizerBase | None:
    if path.name == SENTENCEPIECE_FILE or path.suffix == ".model":
        return _from_sentencepiece_bytes(path.read_bytes(), str(path))
    if path.name in CONFIG_FILES:
        return _from_folder(path.parent)
    if path.name.endswith(SAFETENSORS_SUFFIX):
        return _spiece_tensor([path])
    return None


def _embedding_rows(text_encoder_paths: list[Path]) -> tuple[int, Path] | None:
    from modules.modelLoader.wan.parts.text_encoder_files import text_encoder_keys
    keys = read_keys_and_shapes(text_encoder_paths)
    found = text_encoder_keys(keys)
    if found is None:
        return None
    return keys[found.names["shared.weight"]].shape[0], text_encoder_paths[0]


def _misfit(tokenizer: PreTrainedTokenizerBase, rows: tuple[int, Path] | None) -> str | None:
    """Why the tokenizer is not the text encoder's, or None. UMT5's tokenizer about fills its embedding (256384 rows,
    padded to a multiple of 128); another model's does not come near (T5's has 32100 tokens, CLIP's 49408)."""
    if rows is None or 0.9 * rows[0] <= len(tokenizer) <= 1.1 * rows[0]:
        return None
    return f"{len(tokenizer)} tokens, but the text encoder {rows[1]} embeds {rows[0]}"


def find_tokenizer(folder_or_file: Path | None, text_encoder_paths: list[Path], allow_download: bool,
                   hub_id: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer for a model given as files (see the module docstring for where it is looked for), checked
    against the text encoder's embedding size when the text encoder is given."""
    looked: list[str] = []
    text_encoder_paths = [Path(p) for p in text_encoder_paths]
    rows = _embedding_rows(text_encoder_paths) if text_encoder_paths else None

    def checked(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
        if problem := _misfit(tokenizer, rows):
            origin = getattr(tokenizer, "name_or_path", "") or "the tokenizer found"
            raise ModelFileError(f"{origin}: {problem}: not this encoder's tokenizer; set model.tokenizer.path to "
                                 f"the UMT5 tokenizer")
        return tokenizer

    path = Path(folder_or_file) if folder_or_file is not None and str(folder_or_file).strip() else None
    if path is not None and path.exists():
        found = _named_in(path) if path.is_dir() else _from_file(path)
        if found is not None:
            return checked(found)
        looked.append(str(path))
    if text_encoder_paths:
        found = _spiece_tensor(text_encoder_paths)
        if found is not None:
            return checked(found)
        looked.append(f"{text_encoder_paths[0]} (no {SPIECE_MODEL_KEY!r} tensor)")
        for candidate in _spiece_files_beside(text_encoder_paths):
            found = _spiece_tensor([candidate])
            if (problem := _misfit(found, rows)) is None:
                return found
            looked.append(f"{candidate} (skipped: {problem})")
        beside = text_encoder_paths[0].parent
        found = _named_in(beside) or _named_in(beside.parent)
        if found is not None:
            return checked(found)
        looked.append(f"{beside} (no tokenizer folder beside the text encoder)")
    if path is not None and path.is_dir():
        for candidate in _search(path):
            found = _from_folder(candidate)
            if (problem := _misfit(found, rows)) is None:
                return found
            looked.append(f"{candidate} (skipped: {problem})")
    if allow_download and hub_id:
        return checked(AutoTokenizer.from_pretrained(hub_id))
    download = (f"; or set model.allow_download: true to fetch {hub_id}" if hub_id and not allow_download else "")
    raise ModelFileError(f"no UMT5 tokenizer found (looked in: {'; '.join(looked) or 'nothing given'}): set "
                         f"model.tokenizer.path to a tokenizer folder (a diffusers folder's tokenizer/, the official "
                         f"release's google/umt5-xxl/), a sentencepiece spiece.model, or a ComfyUI umt5_xxl "
                         f"safetensors file holding a 'spiece_model' tensor{download}")


UMT5_HUB_ID = "google/umt5-xxl"


def load_tokenizer(plan, config):
    """The tokenizer of a model plan (modules/modelLoader/wan/parts/model_plan.py) and its ModelConfig:
    `model.tokenizer.path`, the diffusers base's tokenizer/, or the search of `find_tokenizer` (the release's
    google/umt5-xxl, a spiece_model tensor, ...); ModelFileError naming what to point at when none is found."""
    text_encoder = plan.parts["text_encoder"]
    if not config.tokenizer.path and plan.diffusers_base is not None and (plan.diffusers_base / "tokenizer").is_dir():
        return AutoTokenizer.from_pretrained(plan.diffusers_base, subfolder="tokenizer", local_files_only=True)
    where = Path(config.tokenizer.path or config.base_model_name)
    return find_tokenizer(where, list(text_encoder.files), config.allow_download, UMT5_HUB_ID)
