"""Opening a folder in the desktop's file manager. Imports no toolkit."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def open_command(path: str | Path) -> list[str]:
    """The command that shows `path` in the file manager (xdg-open on Linux, open on macOS)."""
    return ["open", str(path)] if sys.platform == "darwin" else ["xdg-open", str(path)]


def open_folder(path: str | Path) -> str | None:
    """Opens the folder (made first, so a run's output folder opens before it has files); returns why not, or None.
    Without a file manager (a server, a container) the answer is the folder's absolute path, to copy."""
    folder = Path(path).expanduser().absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if sys.platform == "win32":
            os.startfile(folder)  # noqa: S606  (Windows' own "open with the file manager")
            return None
        command = open_command(folder)
        if shutil.which(command[0]) is None:
            return (f"There is no file manager to open it with ({command[0]} is not installed). The folder is:"
                    f"\n\n{folder}")
        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as error:
        return f"The folder could not be opened ({error.strerror or error}). It is:\n\n{folder}"
    return None
