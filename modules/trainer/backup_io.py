"""Backups hold only safetensors and JSON: trainable tensors, optimizer and EMA state, RNG states and the exact
training position. A backup folder is written under a temporary name, fsynced and renamed, so it is complete or
absent; its `manifest.json` lists every file with its size, so a backup damaged later (a truncated or emptied file,
a garbled header) is found by `verify_backup` before a resume uses it. Writers of other backup layouts (distributed
checkpoints) call `write_manifest` on their folder and get the same verification."""
import json
import re
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.util.atomic import atomic_dir

PROGRESS_FILE = "progress.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = ("trainable.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
                  "rng.safetensors", "rng.json", PROGRESS_FILE)


@dataclass
class TrainProgress:
    epoch: int = 0
    epoch_batch: int = 0     # batches of the current epoch already consumed
    global_step: int = 0     # optimizer steps taken
    micro_step: int = 0      # batches taken in all (for the per-batch RNG)


def _split_state(state: dict, prefix: str = "") -> tuple[dict[str, torch.Tensor], object]:
    """Nested optimizer state -> (flat tensors, JSON skeleton with {"__tensor__": key} placeholders)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}  # bitsandbytes shares state tensors between parameters: store each once

    def visit(value, path):
        if isinstance(value, torch.Tensor):
            identity = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if value.data_ptr() and identity in seen:
                return {"__tensor__": seen[identity]}
            seen[identity] = path
            tensors[path] = value.detach().cpu().contiguous()
            return {"__tensor__": path}
        if isinstance(value, dict):
            return {"__dict__": [[visit(k, f"{path}.k{i}"), visit(v, f"{path}.{i}")]
                                 for i, (k, v) in enumerate(value.items())]}
        if isinstance(value, (list, tuple)):
            return {"__list__": [visit(v, f"{path}.{i}") for i, v in enumerate(value)],
                    "tuple": isinstance(value, tuple)}
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            return {"__float__": repr(value)}
        return value

    return tensors, visit(state, prefix or "s")


def _join_state(skeleton, tensors: dict[str, torch.Tensor]):
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            return {_join_state(k, tensors): _join_state(v, tensors) for k, v in skeleton["__dict__"]}
        if "__list__" in skeleton:
            items = [_join_state(v, tensors) for v in skeleton["__list__"]]
            return tuple(items) if skeleton["tuple"] else items
        if "__float__" in skeleton:
            return float(skeleton["__float__"])
    return skeleton


def save_nested(state: dict, folder: Path, name: str) -> None:
    tensors, skeleton = _split_state(state)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def load_nested(folder: Path, name: str):
    tensors = load_file(str(folder / f"{name}.safetensors"))
    return _join_state(json.loads((folder / f"{name}.json").read_text()), tensors)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_backup(folder: Path, progress: TrainProgress, trainable: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer | dict, scheduler, ema, config_json: dict,
                 rng: dict | None = None, extra_json: dict[str, object] | None = None) -> None:
    """`optimizer`: the optimizer or its state dict (a multi-process run gathers it); `rng`: default this
    process's states; `extra_json`: more files, name -> JSON value."""
    with atomic_dir(folder) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        save_nested(optimizer if isinstance(optimizer, dict) else optimizer.state_dict(), tmp, "optimizer")
        (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=str))
        if ema is not None:
            save_file(ema.state_dict(), str(tmp / "ema.safetensors"))
        save_nested(rng if rng is not None else rng_state(), tmp, "rng")
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        for name, value in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(value))
        (tmp / PROGRESS_FILE).write_text(json.dumps(asdict(progress)))
        write_manifest(tmp)


def read_backup(folder: Path) -> dict:
    scheduler_state = json.loads((folder / "scheduler.json").read_text())
    return {
        "progress": TrainProgress(**json.loads((folder / PROGRESS_FILE).read_text())),
        "trainable": load_file(str(folder / "trainable.safetensors")),
        "optimizer": load_nested(folder, "optimizer"),
        "scheduler": scheduler_state,
        "ema": load_file(str(folder / "ema.safetensors")) if (folder / "ema.safetensors").is_file() else None,
        "rng": load_nested(folder, "rng"),
    }


_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def list_backups(backup_root: Path) -> list[Path]:
    """Backup folders (`step-NNNNNNNN`, complete or not: see verify_backup), oldest first by step."""
    if not backup_root.is_dir():
        return []
    found = [p for p in backup_root.iterdir() if p.is_dir() and _STEP_FOLDER.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_FOLDER.match(p.name).group(1)))


def prune_backups(backup_root: Path, keep: int) -> None:
    for old in list_backups(backup_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---- verification --------------------------------------------------------------------------------------------

def write_manifest(folder: Path) -> None:
    """Lists every file of `folder` (recursively) with its size; written last, inside the temporary folder."""
    sizes = {str(p.relative_to(folder).as_posix()): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST_FILE}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": sizes}, indent=1))


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read whole (None when it can): its header must parse as JSON and its tensors
    must end exactly at the end of the file. Reads only the header."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is {'empty' if size == 0 else 'truncated'} ({size} bytes)"
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        if header_size > size - 8:
            return f"{path.name} is truncated or its header is damaged (header of {header_size} bytes, file of {size})"
        try:
            header = json.loads(file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{path.name}: its header is not valid JSON (damaged)"
    if not isinstance(header, dict):
        return f"{path.name}: its header is not a JSON object (damaged)"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + header_size + max(ends, default=0)
    if expected != size:
        return f"{path.name} is truncated or padded: its tensors need {expected} bytes, the file has {size}"
    return None


def verify_backup(folder: Path) -> list[str]:
    """Everything wrong with a backup folder, one line each ([] when it can be resumed from). Cheap: sizes and
    headers are checked, the tensor data is not read."""
    problems = []
    manifest_path = folder / MANIFEST_FILE
    expected: dict[str, int] = {}
    if manifest_path.is_file():
        try:
            expected = json.loads(manifest_path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            problems.append(f"{MANIFEST_FILE} is damaged")
    names = set(expected) | set(REQUIRED_FILES)
    for name in sorted(names):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if name in expected and size != expected[name]:
            problems.append(f"{name} has {size} bytes, {expected[name]} were written"
                            + (" (emptied)" if size == 0 else " (truncated or changed)"))
            continue
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
            if problem:
                problems.append(problem)
        elif name.endswith(".json"):
            try:
                json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                problems.append(f"{name} is not valid JSON" + (" (empty)" if size == 0 else " (damaged)"))
    return problems


def newest_usable_backup(backup_root: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """(the newest backup that verifies, [(each newer damaged backup, its problems)])."""
    damaged = []
    for folder in reversed(list_backups(backup_root)):
        problems = verify_backup(folder)
        if not problems:
            return folder, damaged
        damaged.append((folder, problems))
    return None, damaged


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [name for name, value in tensors.items()
            if value.is_floating_point() and not bool(torch.isfinite(value).all())]
