"""Reading weight files as users hold them: names, shapes and dtypes from the header alone, then tensors one at a
time from a memory map.

Read: `.safetensors` (single or sharded: `*.safetensors.index.json` or the `-0000N-of-0000M` name pattern) and the
`.pth` / `.pt` / `.ckpt` model parts of the official Wan release, which are opened only through PyTorch's restricted
unpickler (`torch.load(weights_only=True)`): it builds tensors and plain containers and refuses any other object, so a
planted pickle cannot run code. Anything that is not a (possibly nested) dict of tensors is refused naming the file.
"""
import json
import os
import pickle
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch


class ModelFileError(Exception):
    """A weight file that cannot be used as given; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # torch's name: "float32", "bfloat16", "float8_e4m3fn", ...

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_MODEL_SUFFIXES = (".pth", ".pt", ".ckpt")
WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, *PICKLE_MODEL_SUFFIXES)
INDEX_SUFFIX = ".safetensors.index.json"

# safetensors' dtype codes (safetensors/src/tensor.rs `Dtype`) -> torch dtype names
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.safetensors)$")
# containers that checkpoints wrap a state dict in (training scripts' {"state_dict": ...}, {"model": ...})
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module")


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    offsets: dict[str, tuple[int, int]]  # absolute byte range of each tensor in the file


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Reads only the JSON header; checks that every tensor's bytes lie inside the file (a truncated download is
    reported here, before any weights load)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
            header_size = struct.unpack("<Q", head)[0]
            if header_size > size - 8 or header_size > 512 * 1024 * 1024:
                raise ModelFileError(f"{path}: the header claims {header_size} bytes but the file holds {size}: "
                                     f"not a safetensors file, or truncated")
            raw = file.read(header_size)
    except OSError as error:
        raise ModelFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ModelFileError(f"{path}: the safetensors header is not valid JSON (damaged or not a safetensors "
                             f"file)") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - header_size
    tensors: dict[str, TensorInfo] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: header entry {key!r} is malformed") from None
        if end > data_size:
            raise ModelFileError(f"{path}: truncated: tensor {key!r} ends at byte {end} of the data but the file "
                                 f"holds only {data_size} bytes of data (download it again)")
        tensors[key] = TensorInfo(shape, _SAFETENSORS_DTYPES.get(dtype, dtype.lower()))
        offsets[key] = (8 + header_size + begin, 8 + header_size + end)
    return SafetensorsHeader(tensors, {str(k): str(v) for k, v in metadata.items()}, offsets)


def _torch_load(path: Path) -> Mapping[str, torch.Tensor]:
    """The restricted unpickler only: it refuses every global outside torch's tensor-rebuild allow-list, so a pickle
    that would run code raises instead. mmap keeps the tensors on disk until they are used."""
    try:
        try:
            loaded = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            # the legacy (pre-zip) torch format cannot be memory-mapped; it is read whole, still restricted
            loaded = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ModelFileError(f"{path}: refused: the file needs more than tensors to load (PyTorch's restricted "
                             f"loader, weights_only=True, stopped at: {first_line[:300]}); only model weights "
                             f"are read from .pth files") from None
    except (RuntimeError, EOFError, OSError, ValueError, struct.error) as error:
        raise ModelFileError(f"{path}: cannot be read as a PyTorch weight file ({str(error)[:300]})") from None
    return _flatten_state_dict(loaded, path)


def _flatten_state_dict(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(loaded, dict):
        raise ModelFileError(f"{path}: holds a {type(loaded).__name__}, not a dict of tensors; only model weights "
                             f"are read from .pth files")
    while len(loaded) == 1 and next(iter(loaded)) in _WRAPPER_KEYS and isinstance(next(iter(loaded.values())), dict):
        loaded = next(iter(loaded.values()))
    flat: dict[str, torch.Tensor] = {}

    def visit(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, torch.Tensor):
                flat[name] = value
            elif isinstance(value, dict):
                visit(value, f"{name}.")
            else:
                raise ModelFileError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor; only "
                                     f"dicts of tensors are read from .pth files")

    visit(loaded, "")
    if not flat:
        raise ModelFileError(f"{path}: holds no tensors")
    return flat


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_weight_file(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(WEIGHT_SUFFIXES)


def shard_set(path: str | Path) -> list[Path]:
    """The files that one weight file belongs to: all shards of a sharded set (by its index or by the
    `-0000N-of-0000M` names), else the file itself. A missing shard is an error naming it."""
    path = Path(path)
    if path.name.endswith(INDEX_SUFFIX):
        try:
            weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelFileError(f"{path}: not a valid safetensors index (needs a 'weight_map' object)") from None
        shards = [path.parent / name for name in names]
        if not all(name.endswith(SAFETENSORS_SUFFIX) for name in names):
            raise ModelFileError(f"{path}: a safetensors index naming other files ({', '.join(names[:3])}); only "
                                 f"safetensors shards are read through an index")
    elif match := _SHARD_NAME.match(path.name):
        count = int(match["count"])
        shards = [path.parent / f"{match['stem']}-{i:05d}-of-{count:05d}{match['suffix']}" for i in range(1, count + 1)]
    else:
        if not path.is_file():
            raise ModelFileError(f"{path}: no such file")
        return [path]
    missing = [shard for shard in shards if not shard.is_file()]
    if missing:
        raise ModelFileError(f"{missing[0]}: shard missing from the sharded set of {path.name} "
                             f"({len(missing)} of {len(shards)} shards missing)")
    return shards


def group_weight_files(folder: str | Path) -> list[list[Path]]:
    """The weight files directly in `folder`, shards of one set grouped together (sorted, stable)."""
    folder = Path(folder)
    groups: list[list[Path]] = []
    seen: set[Path] = set()
    entries = sorted(p for p in folder.iterdir() if p.is_file())
    for entry in entries:  # indexes first claim their shards
        if entry.name.endswith(INDEX_SUFFIX):
            group = shard_set(entry)
            groups.append(group)
            seen.update(group)
    for entry in entries:
        if entry in seen or not entry.name.lower().endswith(WEIGHT_SUFFIXES):
            continue
        group = shard_set(entry)
        groups.append(group)
        seen.update(group)
    return groups


def read_keys_and_shapes(paths: str | Path | Iterable[str | Path]) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of every tensor of a file (or of a sharded set, given any shard, its index or the
    list of files), without reading weights. A key present in two files is an error."""
    files = _expand(paths)
    result: dict[str, TensorInfo] = {}
    owner: dict[str, Path] = {}
    for file in files:
        for key, info in _read_one(file).items():
            if key in result:
                raise ModelFileError(f"{file}: tensor {key!r} is also in {owner[key]}")
            result[key] = info
            owner[key] = file
    return result


def read_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (the first shard's for a set); empty for .pth files."""
    first = _expand(path)[0]
    return read_safetensors_header(first).metadata if first.name.endswith(SAFETENSORS_SUFFIX) else {}


def _expand(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        return shard_set(paths)
    files: list[Path] = []
    for path in paths:
        files.extend(p for p in shard_set(path) if p not in files)
    if not files:
        raise ModelFileError("no weight files given")
    return files


def _read_one(path: Path) -> dict[str, TensorInfo]:
    """Cached by (path, size, mtime): planning, the GUI's descriptions and the loader read the same headers."""
    try:
        stat = path.stat()
    except OSError as error:
        raise ModelFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    return _read_one_cached(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _read_one_cached(name: str, size: int, mtime_ns: int) -> dict[str, TensorInfo]:
    path = Path(name)
    if path.name.lower().endswith(SAFETENSORS_SUFFIX):
        return read_safetensors_header(path).tensors
    if path.name.lower().endswith(PICKLE_MODEL_SUFFIXES):
        return {key: TensorInfo(tuple(t.shape), _dtype_name(t.dtype)) for key, t in _torch_load(path).items()}
    raise ModelFileError(f"{path}: not a weight file that is read (.safetensors, or .pth/.pt/.ckpt model parts)")


class _SafetensorsReader:
    """Reads one tensor's bytes straight into a new tensor (os.pread): no memory map, so the process holds only the
    tensors it keeps; a mapped file's touched pages would count as a second copy until it is closed."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = -1
        self.header = read_safetensors_header(path)  # the truncation check, before any weights are read
        self._fd = os.open(path, os.O_RDONLY)

    def keys(self):
        return self.header.tensors.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self.header.tensors[key]
        begin, end = self.header.offsets[key]
        dtype = getattr(torch, info.dtype)
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        while done < end - begin:
            count = os.preadv(self._fd, [view[done:]], begin + done)
            if count <= 0:
                raise ModelFileError(f"{self.path}: truncated while reading tensor {key!r}")
            done += count
        if end == begin:
            return torch.empty(info.shape, dtype=dtype)
        return buffer.view(dtype).reshape(info.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


class LazyTensors(Mapping):
    """key -> tensor over one or more files, each tensor read when asked for (one at a time: the caller casts /
    assigns it and drops it before the next). `.pth` files are memory-mapped by torch.load."""

    def __init__(self, paths: str | Path | Iterable[str | Path]):
        self.files = _expand(paths)
        self._owner: dict[str, int] = {}
        self._handles: list = []
        for index, file in enumerate(self.files):
            if file.name.lower().endswith(SAFETENSORS_SUFFIX):
                handle = _SafetensorsReader(file)
                keys = list(handle.keys())
            else:
                handle = _read_one_pth(file)
                keys = list(handle.keys())
            self._handles.append(handle)
            for key in keys:
                if key in self._owner:
                    raise ModelFileError(f"{file}: tensor {key!r} is also in {self.files[self._owner[key]]}")
                self._owner[key] = index

    def __getitem__(self, key: str) -> torch.Tensor:
        handle = self._handles[self._owner[key]]
        return handle[key] if isinstance(handle, dict) else handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def file_of(self, key: str) -> Path:
        return self.files[self._owner[key]]

    def close(self) -> None:
        for handle in self._handles:
            if isinstance(handle, _SafetensorsReader):
                handle.close()
        self._handles.clear()
        self._owner.clear()

    def __enter__(self) -> "LazyTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_one_pth(path: Path) -> dict[str, torch.Tensor]:
    return dict(_torch_load(path))


def open_tensors(paths: str | Path | Iterable[str | Path]) -> LazyTensors:
    return LazyTensors(paths)


# ComfyUI checkpoints prefix the diffusion model's keys (comfy/model_detection.py `unet_prefix_from_state_dict`);
# some exports keep only `diffusion_model.`. Longest first.
DIFFUSION_MODEL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# the other models' prefixes in a checkpoint bundling several (comfy/supported_models.py, supported_models_base.py:
# ComfyUI's save_checkpoint writes a Wan VAE under `vae.`, older checkpoints `first_stage_model.`)
BUNDLED_MODEL_PREFIXES = ("vae.", "first_stage_model.", "text_encoders.", "cond_stage_model.", "clip_vision.")


def detect_prefix(keys: Iterable[str], prefixes: Iterable[str] = DIFFUSION_MODEL_PREFIXES) -> str:
    """The prefix that most keys carry, or "" when none does."""
    keys = list(keys)
    for prefix in prefixes:
        if keys and sum(key.startswith(prefix) for key in keys) * 2 > len(keys):
            return prefix
    return ""


def strip_prefix_keys(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """stripped name -> original name (keys without the prefix are kept as they are)."""
    return {(key[len(prefix):] if prefix and key.startswith(prefix) else key): key for key in keys}


def strip_prefix(mapping: Mapping[str, object], prefixes: Iterable[str] = DIFFUSION_MODEL_PREFIXES) -> dict:
    """The mapping with the detected diffusion-model prefix removed from its keys (the values untouched: for a
    `LazyTensors` use `strip_prefix_keys` and read through the original names)."""
    prefix = detect_prefix(mapping.keys(), prefixes)
    return {new: mapping[old] for new, old in strip_prefix_keys(mapping.keys(), prefix).items()}
