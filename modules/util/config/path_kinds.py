"""What a configured path is, said the same way for every field: missing, a folder where a file is needed, or not
a regular file at all (a device such as /dev/null or /dev/zero, a FIFO, a socket, or a link to one). Nothing is
opened: a FIFO would block the read, a device would never end it."""
from pathlib import Path


def path_problem(field: str, path: str, want: str) -> str | None:
    """Why `path` cannot be the `want` ('file', 'folder' or 'file or folder') that `field` names, or None."""
    where = Path(path)
    if where.is_dir():
        return None if want != "file" else f"{field}: {path!r} is a folder; a file is needed"
    if where.is_file():
        return None if want != "folder" else f"{field}: {path!r} is a file, not a folder"
    if where.exists():
        return (f"{field}: {path!r} is not a regular file (a device, FIFO or socket, or a link to one); name a "
                f"{want}")
    return f"{field}: {path!r} does not exist"
