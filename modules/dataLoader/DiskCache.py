"""A folder of safetensors files, one per encoded item, keyed by a hash of everything that changes the result.
Each file is written atomically, so a killed caching run leaves only complete entries and resumes where it
stopped."""
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from modules.util.atomic import save_safetensors_atomic


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def file_identity(path: str) -> list:
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


class DiskCache:
    def __init__(self, root: str | Path, namespace: str):
        self.folder = Path(root) / namespace
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self._path(key)
        return load_file(str(path)) if path.is_file() else None

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        save_safetensors_atomic({k: v.detach().cpu() for k, v in tensors.items()}, self._path(key))
