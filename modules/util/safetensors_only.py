"""The one gate every weight file a user names passes: only safetensors are read. Pickle-based formats (.bin, .pt,
.pth, .ckpt) can run arbitrary code when loaded, so they are refused by name, never handed to a loader that might
unpickle them (diffusers falls back to `.bin` files, torch.load to pickle)."""
import json
import os
import struct
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class NotSafetensorsError(ValueError):
    """A weight file in a format that is not read. The message names the file and says what is read."""


def _refusal(path: Path, what: str, why: str) -> NotSafetensorsError:
    return NotSafetensorsError(f"{what}: {str(path)!r} {why}; only safetensors files are read (pickle-based "
                               f"formats can run code when loaded): convert it to .safetensors with the tool that "
                               f"made it")


def require_safetensors(path: str | os.PathLike, what: str) -> Path:
    """Raises NotSafetensorsError unless `path` is a safetensors file (its suffix and its first bytes)."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise _refusal(path, what, f"is a {path.suffix} file")
    if not path.is_file():
        return path  # a missing file is reported by whoever opens it, with its own message
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(9)
    if len(head) < 9 or head[8:9] != b"{" or struct.unpack("<Q", head[:8])[0] > size - 8:
        if head[:2] == b"PK":
            raise _refusal(path, what, "is a zip archive (torch's pickle format)")
        if head[:1] == b"\x80":
            raise _refusal(path, what, "is a pickle")
        raise _refusal(path, what, "is not a safetensors file")
    return path


def refuse_pickled_folder(folder: str | os.PathLike, what: str) -> None:
    """A diffusers / transformers model folder must hold its weights as safetensors: one that holds only pickled
    weights (`diffusion_pytorch_model.bin`, `pytorch_model.bin`, ...) is refused naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    names = [p.name for p in folder.iterdir() if p.is_file()]
    if any(name.endswith(".safetensors") or name.endswith(".safetensors.index.json") for name in names):
        return
    pickled = sorted(name for name in names if Path(name).suffix.lower() in PICKLE_SUFFIXES
                     or (name.endswith(".index.json") and _indexes_pickles(folder / name)))
    if pickled:
        raise _refusal(folder / pickled[0], what, "holds pickled weights")


def _indexes_pickles(index: Path) -> bool:
    try:
        files = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return False
    return any(Path(name).suffix.lower() in PICKLE_SUFFIXES for name in files)
