"""Atomic writes: write to a temporary name beside the target, fsync it, rename it, fsync the folder, so neither a
crash nor a power loss leaves half a file or a renamed but empty one.

Temporary names are `.<target name>.<random>.tmp` (files and folders alike); `remove_stale_temporaries` removes the
ones a killed process left behind."""
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from modules.util.kill_points import kill_point


def fsync_path(path: str | os.PathLike) -> None:
    """Flushes a file's data (or a folder's entries) to the disk. Folders cannot be opened on Windows: skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and folders on some platforms) refuse fsync; there is nothing better to do
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(root)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary file path in the target's folder; renames it onto `path` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file private (0600); give it the permissions a plain open() would have
        os.chmod(tmp, 0o666 & ~_umask())
        fsync_path(tmp)
        kill_point()
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary folder beside `path`; on success the old folder (if any) is replaced by it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        kill_point()
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_safetensors_atomic(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`tensors` (on any device, or `safetensors_stream.Deferred`) written one at a time: a save never holds a
    second copy of them all."""
    from modules.util.safetensors_stream import write_safetensors
    with atomic_path(path) as tmp:
        write_safetensors(tensors, tmp, metadata)


# `.<name>.<8 random characters from mkstemp / mkdtemp>.tmp`, and atomic_dir's `.<name>.old`
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$|^\..+\.old$")


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.match(name))


def remove_stale_temporaries(folders: Iterable[str | os.PathLike], recursive: bool = True,
                              prefix: str = "") -> list[Path]:
    """Removes the temporary files and folders that writes killed mid-way left in `folders` (and, when `recursive`,
    their subfolders) whose names start with `.<prefix>`; returns what was removed. Call it at the start of a run,
    before anything writes there: a concurrent writer's temporary file looks the same."""
    removed = []
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        entries = folder.rglob(".*") if recursive else folder.glob(".*")
        for entry in sorted(entries, key=lambda p: len(p.parts)):
            if not entry.name.startswith(f".{prefix}") or not is_temporary(entry.name) or not entry.exists():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
