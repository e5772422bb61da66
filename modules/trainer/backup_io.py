"""Backups hold only safetensors and JSON: trainable tensors, optimizer and EMA state, RNG states and the exact
training position. A backup folder is written under a temporary name, fsynced and renamed, so it is complete or
absent; its `manifest.json`, written last, lists every file with its size and SHA-256 and the time it was written,
so a backup damaged later (a truncated or emptied file, a garbled header, flipped bits, a lost manifest) is found by
`verify_backup` before a resume uses it. Writers of other backup layouts (distributed checkpoints) call
`write_manifest` on their folder and get the same verification.

Backups belong to their run: `<workspace>/backup/<run name>/step-N`. Rolling pruning keeps the newest N of one run
by the time they were written, so runs sharing a workspace never delete or overwrite each other's. Workspaces of
earlier versions held every run's backups directly in `<workspace>/backup/`: those are still found (by the run name
their config records) and never pruned."""
import hashlib
import json
import re
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from modules.util.atomic import atomic_dir
from modules.util.safetensors_stream import write_safetensors

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
            tensors[path] = value.detach()   # brought to the host one at a time as it is written
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
    write_safetensors(tensors, folder / f"{name}.safetensors")
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
        # each tensor comes to the host as it is written: never a host copy of all the trained weights at once
        write_safetensors(trainable, tmp / "trainable.safetensors")
        save_nested(optimizer if isinstance(optimizer, dict) else optimizer.state_dict(), tmp, "optimizer")
        (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=str))
        if ema is not None:
            write_safetensors(ema.state_dict(), tmp / "ema.safetensors")
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


def written_at(folder: Path) -> float:
    """When the backup was written (its manifest says; a manifest of an earlier version: the folder's time)."""
    try:
        return float(json.loads((folder / MANIFEST_FILE).read_text())["written_at"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return folder.stat().st_mtime
        except OSError:
            return 0.0


def backup_step(folder: Path) -> int:
    match = _STEP_FOLDER.match(folder.name)
    return int(match.group(1)) if match else -1


def list_backups(run_folder: Path) -> list[Path]:
    """The rolling backups (`step-NNNNNNNN`, complete or not: see verify_backup) of one run's folder, oldest first
    by the time they were written (a run resumed from an earlier step writes lower steps later)."""
    if not run_folder.is_dir():
        return []
    found = [p for p in run_folder.iterdir() if p.is_dir() and _STEP_FOLDER.match(p.name)]
    return sorted(found, key=lambda p: (written_at(p), backup_step(p)))


def prune_backups(run_folder: Path, keep: int) -> list[Path]:
    """Deletes all but the newest `keep` backups of this one run; returns what it deleted."""
    removed = list_backups(run_folder)[:-keep] if keep > 0 else []
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def backup_run_name(folder: Path) -> str:
    """The run a backup belongs to, as its config records it ('' when it does not)."""
    try:
        return str(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("run_name") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def workspace_backups(backup_base: Path) -> dict[str, list[Path]]:
    """Every run's rolling backups in a workspace's `backup/` folder: run name -> backups, oldest first. Backups of
    earlier versions, directly in `backup/`, join the run their config names."""
    runs: dict[str, list[Path]] = {}
    if not backup_base.is_dir():
        return runs
    for entry in backup_base.iterdir():
        if not entry.is_dir():
            continue
        if _STEP_FOLDER.match(entry.name):
            runs.setdefault(backup_run_name(entry), []).append(entry)
        else:
            backups = list_backups(entry)
            if backups:
                runs.setdefault(entry.name, []).extend(backups)
    return {name: sorted(found, key=lambda p: (written_at(p), backup_step(p))) for name, found in runs.items()}


def all_backups(backup_base: Path) -> list[Path]:
    """Every rolling backup of every run of a workspace, oldest first by the time written."""
    found = [p for backups in workspace_backups(backup_base).values() for p in backups]
    return sorted(found, key=lambda p: (written_at(p), backup_step(p)))


@dataclass
class ResumeChoice:
    """The backup a resume continues from: the newest that verifies of the run being continued."""
    run_name: str                         # the run continued ('' when the workspace has no backup)
    folder: Path | None                   # None: nothing usable, the run starts fresh
    damaged: list[tuple[Path, list[str]]]  # newer backups of that run skipped, with their problems
    set_aside: list[Path] = field(default_factory=list)  # its backups an earlier resume found damaged

    def describe(self) -> str:
        if self.folder is None:
            return "no usable backup"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written_at(self.folder)))
        step = json.loads((self.folder / PROGRESS_FILE).read_text())["global_step"]
        return f"resuming run {self.run_name or '(unnamed)'} from step {step}, written at {stamp} ({self.folder})"


def choose_backup(backup_base: Path, run_name: str = "") -> ResumeChoice:
    """The newest backup of run `run_name` that verifies (its checksums included); with no name, of the run whose
    backup was written last. Never a backup of another run."""
    runs = workspace_backups(backup_base)
    if not run_name:
        newest = max(((written_at(b[-1]), name) for name, b in runs.items() if b), default=None)
        if newest is None:
            return ResumeChoice("", None, [])
        run_name = newest[1]
    damaged = []
    for folder in reversed(runs.get(run_name, [])):
        problems = verify_backup(folder, checksums=True)
        if not problems:
            return ResumeChoice(run_name, folder, damaged)
        damaged.append((folder, problems))
    return ResumeChoice(run_name, None, damaged, set_aside_backups(backup_base / run_name))


_SET_ASIDE = re.compile(r"^step-\d+\.damaged(-\d+)?$")


def set_aside_backups(run_folder: Path) -> list[Path]:
    """The backups of one run's folder that a resume found damaged and renamed `step-N.damaged` (oldest first)."""
    if not run_folder.is_dir():
        return []
    found = [p for p in run_folder.iterdir() if p.is_dir() and _SET_ASIDE.match(p.name)]
    return sorted(found, key=lambda p: (written_at(p), p.name))


def set_aside(folder: Path) -> Path | None:
    """Renames a damaged backup to `step-N.damaged` (kept for a look, no longer a rolling backup): left in place it
    would count towards backup.rolling_count, and the pruning would delete the good older backups instead. Returns
    the new name, or None when it cannot be renamed (it is skipped at every resume then)."""
    target, number = folder.with_name(f"{folder.name}.damaged"), 1
    while target.exists():
        number += 1
        target = folder.with_name(f"{folder.name}.damaged-{number}")
    try:
        folder.rename(target)
    except OSError:
        return None
    return target


# what decides the trainable tensors' names and shapes: a backup resumes only into a run where these are alike
_SHAPING_KEYS = ("model_type", "training_method", "expert", "model.", "lora.", "fine_tune.", "embedding.", "e2v.")


def _flat(value: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict) and item:
            flat.update(_flat(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def config_changes(folder: Path, config_json: dict, limit: int = 6) -> list[str]:
    """The settings that shape what trains and differ between the backup's config and `config_json`, as
    'lora.rank: 8 in the backup, 16 now' ([] when none differ or the backup's config cannot be read)."""
    try:
        saved = _flat(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return []
    now = _flat(config_json)
    keys = sorted(k for k in set(saved) | set(now) if k.startswith(_SHAPING_KEYS) and saved.get(k) != now.get(k))
    return [f"{key}: {saved.get(key)!r} in the backup, {now.get(key)!r} now" for key in keys[:limit]]


# ---- verification --------------------------------------------------------------------------------------------

def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Lists every file of `folder` (recursively) with its size and SHA-256, and the time; written last, inside the
    temporary folder."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE]
    manifest = {"written_at": time.time(),
                "files": {str(p.relative_to(folder).as_posix()): p.stat().st_size for p in files},
                "sha256": {str(p.relative_to(folder).as_posix()): file_sha256(p) for p in files}}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


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


def verify_backup(folder: Path, checksums: bool = False) -> list[str]:
    """Everything wrong with a backup folder, one line each ([] when it can be resumed from). Without `checksums`
    it is cheap (sizes and headers; the tensor data is not read); with them every file's SHA-256 is compared with
    the manifest's (a resume reads every byte anyway). A backup without its manifest cannot be checked and is not
    used."""
    problems = []
    manifest_path = folder / MANIFEST_FILE
    expected: dict[str, int] = {}
    hashes: dict[str, str] = {}
    if not manifest_path.is_file():
        problems.append(f"{MANIFEST_FILE} is missing, so nothing in the backup can be checked")
    else:
        try:
            manifest = json.loads(manifest_path.read_text())
            expected, hashes = manifest["files"], manifest.get("sha256", {})
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
                continue
        if checksums and name in hashes and file_sha256(path) != hashes[name]:
            problems.append(f"{path} does not match its checksum (the data changed after it was written)")
    return problems


def newest_usable_backup(run_folder: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """(the newest backup of one run's folder that verifies cheaply, [(each newer damaged backup, its problems)])."""
    damaged = []
    for folder in reversed(list_backups(run_folder)):
        problems = verify_backup(folder)
        if not problems:
            return folder, damaged
        damaged.append((folder, problems))
    return None, damaged


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [name for name, value in tensors.items()
            if value.is_floating_point() and not bool(torch.isfinite(value).all())]
