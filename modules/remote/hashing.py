"""SHA-256 of files, here and on the remote. Local hashes are kept per (path, size, mtime) so a large dataset is read
once, not on every run; the remote hashes with coreutils' sha256sum, which every Linux has."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

CHUNK = 1 << 20


def file_sha256(path: str | os.PathLike, limit: int | None = None) -> str:
    """The SHA-256 of the file, or of its first `limit` bytes."""
    digest = hashlib.sha256()
    left = limit
    with open(path, "rb") as file:
        while left is None or left > 0:
            block = file.read(CHUNK if left is None else min(CHUNK, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


class LocalHashes:
    """Hashes of local files, remembered in a JSON file and trusted only while the file's size and mtime hold."""

    def __init__(self, cache_file: str | os.PathLike):
        self.cache_file = Path(cache_file)
        try:
            self.known = json.loads(self.cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def sha256(self, path: Path) -> tuple[str, int]:
        stat = path.stat()
        key = str(path)
        entry = self.known.get(key)
        if isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return entry[2], stat.st_size
        digest = file_sha256(path)
        self.known[key] = [stat.st_size, stat.st_mtime_ns, digest]
        self.changed = True
        return digest, stat.st_size

    def save(self) -> None:
        if not self.changed:
            return
        from modules.util.atomic import atomic_write_text
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.cache_file, json.dumps(self.known) + "\n")
        self.changed = False


def remote_sha256(connection, paths: list[str]) -> dict[str, str]:
    """{remote path: sha256} of the files that exist (a missing one is left out)."""
    result: dict[str, str] = {}
    for start in range(0, len(paths), 200):   # bounded command lines
        batch = paths[start:start + 200]
        _, out, _ = connection.run("sha256sum -- " + " ".join(shlex.quote(p) for p in batch) + " 2>/dev/null",
                                   check=False)
        for line in out.splitlines():
            digest, _, name = line.partition("  ")
            if len(digest) == 64 and name:
                result[name] = digest
    return result


def remote_tree_sha256(connection, folder: str) -> dict[str, str]:
    """{path relative to folder: sha256} of every file under the remote folder (empty when it is missing)."""
    command = (f"cd {shlex.quote(folder)} 2>/dev/null && find . -type f ! -name '*.partial' -print0 "
               f"| xargs -0 -r sha256sum --")
    _, out, _ = connection.run(command, check=False)
    result = {}
    for line in out.splitlines():
        digest, _, name = line.partition("  ")
        if len(digest) == 64 and name.startswith("./"):
            result[name[2:]] = digest
    return result
