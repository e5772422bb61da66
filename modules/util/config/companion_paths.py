"""The companion paths a concept names, checked before any model loads: `control_path` and `mask_path` are folders of
files named as the concept's clips, `default_mask` one mask file. A typo there would otherwise leave every clip
without its control or mask and train the wrong thing (the scan finds nothing in a folder that is not there), so a
path that cannot be such a folder (file) is refused, naming the field and what is allowed."""
import os
from pathlib import Path

from modules.util.config.path_kinds import path_problem
from modules.util.video_io import MEDIA_EXTENSIONS

# pseudo file systems: their "files" are the kernel's, never a user's controls or masks (/dev/shm is a RAM disk
# that may hold data)
SYSTEM_FOLDERS = (Path("/proc"), Path("/sys"), Path("/dev"))
USER_FOLDERS_IN_SYSTEM = (Path("/dev/shm"),)
FOLDER_FIELDS = {"control_path": "control videos (or folders of frames)", "mask_path": "masks"}
ALLOWED_FOLDER = ("an existing, readable folder holding the {what} named as the concept's clips, not the clips' own "
                  "folder")


def companion_folder_problem(field: str, path: str, what: str, clips: str) -> str | None:
    """Why `path` cannot be the folder of `what` of the concept whose clips are at `clips`, or None."""
    allowed = ALLOWED_FOLDER.format(what=what)
    kind = path_problem(field, path, "folder")
    if kind:
        return f"{kind}; allowed: {allowed}"
    resolved = Path(path).resolve()
    if resolved == Path(resolved.anchor):
        return f"{field}: {path!r} is the file system's root; allowed: {allowed}"
    def under(folder: Path) -> bool:
        return resolved == folder or folder in resolved.parents

    if any(map(under, SYSTEM_FOLDERS)) and not any(map(under, USER_FOLDERS_IN_SYSTEM)):
        return f"{field}: {path!r} is a system folder (under /proc, /sys or /dev); allowed: {allowed}"
    if Path(clips).is_dir() and resolved == Path(clips).resolve():
        # a file named as a clip in the clips' own folder is the clip itself: each clip would be its own control
        return f"{field}: {path!r} is the concept's own folder (data.concepts path); allowed: {allowed}"
    if not os.access(resolved, os.R_OK | os.X_OK):
        return f"{field}: {path!r} cannot be read (no permission); allowed: {allowed}"
    return None


def concept_companion_problems(index: int, concept) -> list[str]:
    """Every problem of the companion paths of the enabled concept number `index`."""
    problems = []
    for name, what in FOLDER_FIELDS.items():
        path = getattr(concept, name)
        if path:
            problem = companion_folder_problem(f"data.concepts.{index}.{name}", path, what, concept.path)
            if problem:
                problems.append(problem)
    if concept.default_mask:
        field = f"data.concepts.{index}.default_mask"
        allowed = f"an image or video file ({', '.join(sorted(MEDIA_EXTENSIONS))})"
        kind = path_problem(field, concept.default_mask, "file")
        if kind:
            problems.append(f"{kind}; allowed: {allowed}")
        elif Path(concept.default_mask).suffix.lower() not in MEDIA_EXTENSIONS:
            problems.append(f"{field}: {concept.default_mask!r} is no image or video; allowed: {allowed}")
    return problems
