"""A folder of safetensors files, one per encoded item, keyed by a hash of everything that changes the result.
Each file is written atomically, so a killed caching run leaves only complete entries and resumes where it
stopped. Each entry's metadata holds a checksum of its key and its tensors (names, dtypes, shapes, bytes): an
entry that no longer reads, lacks a tensor, or whose content changed (bit rot, another entry copied over it) is
reported, deleted and encoded again instead of training on wrong latents."""
import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from modules.util.atomic import save_safetensors_atomic
from modules.util.video_io import frame_files

log = logging.getLogger(__name__)

CHECKSUM_KEY = "entry_sha256"


class CacheWriteError(Exception):
    """An entry could not be written (a full disk, a folder turned read-only); the message names the folder and
    the entry. Entries written before it are complete and kept."""


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def file_identity(path: str) -> list:
    if Path(path).is_dir():  # a folder of frames: every frame's identity (editing one frame changes the key)
        return [str(Path(path).resolve())] + [file_identity(str(p))[1:] + [p.name] for p in frame_files(path)]
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def entry_checksum(key: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the entry's key (so an entry copied over another does not match) and its tensors."""
    digest = hashlib.sha256(key.encode())
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(value.dtype), list(value.shape)]).encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskCache:
    def __init__(self, root: str | Path, namespace: str):
        self.folder = Path(root) / namespace
        self.folder.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()  # keys whose checksum matched in this run: the caching pass reads every
        # entry, and training reads each again every epoch; hashing once per run is enough

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def get(self, key: str, required: Iterable[str] = ()) -> dict[str, torch.Tensor] | None:
        """The entry's tensors; None when there is none, or when it is damaged (then it is deleted, with a notice,
        and the caller encodes it again). `required`: tensor names the entry must hold."""
        path = self._path(key)
        if not path.is_file():
            return None
        problem, tensors = self._read(path, key, verify=key not in self._verified)
        if problem is None:
            missing = sorted(set(required) - set(tensors))
            if missing:
                problem = f"it lacks the tensor(s) {missing}"
        if problem is None:
            self._verified.add(key)
            return tensors
        log.warning("cache entry %s is damaged (%s): encoding it again", path, problem)
        path.unlink(missing_ok=True)
        return None

    @staticmethod
    def _read(path: Path, key: str, verify: bool = True) -> tuple[str | None, dict[str, torch.Tensor]]:
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                # copies: a mapped file changed in place later (truncated) would crash whoever holds its tensors
                tensors = {name: file.get_tensor(name).clone() for name in file.keys()}
        except Exception as error:  # noqa: BLE001  (safetensors raises its own error types for damaged files)
            return f"unreadable: {error}", {}
        if not verify:
            return None, tensors
        if CHECKSUM_KEY not in metadata:
            return "it has no checksum (written by an older version, or not by this trainer)", {}
        if entry_checksum(key, tensors) != metadata[CHECKSUM_KEY]:
            return "its tensors do not match their checksum: the content changed after it was written", {}
        return None, tensors

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        path = self._path(key)
        try:
            save_safetensors_atomic(tensors, path, {CHECKSUM_KEY: entry_checksum(key, tensors)})
        except Exception as error:  # noqa: BLE001  (safetensors raises its own error type for a full disk)
            raise CacheWriteError(f"writing the cache entry {path.name} in {path.parent} failed: {error}; the "
                                  f"entries written before it are kept, and the next run continues from them "
                                  f"(free space there or set cache_dir to another folder)") from error
