"""The checkpoints a comparison samples (docs/compare.md): LoRA files, folders of them (workspace/save), and
training backups (`backup/<run>/step-N`, or a run's backup folder holding several), each read into `LoraWeights`
per expert, labelled with its name and training step."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.lora.formats import LoraWeights, lora_from_state_dict

_STEP_IN_NAME = re.compile(r"(?:^|[-_])(?:step[-_]?)?(\d+)$")


@dataclass
class Checkpoint:
    label: str                       # the file or backup name
    step: int | None                 # the training step it holds, when known
    source: Path
    files: list[Path] = field(default_factory=list)       # LoRA files (read with sample.py's loader)
    backup: Path | None = None                             # or a training backup folder

    @property
    def title(self) -> str:
        return self.label if self.step is None else f"{self.label} (step {self.step})"


def step_from_name(name: str) -> int | None:
    """`step-00000100.safetensors` -> 100, `lora-500` -> 500; None when the name holds no trailing number, or ends in
    a run's name (`lora.previous-2026-11-27_21-51-53.safetensors`, an earlier output kept beside: its seconds are no
    step)."""
    if ".previous-" in name:
        return None
    match = _STEP_IN_NAME.search(name.removesuffix(".safetensors").removesuffix("_high_noise")
                                 .removesuffix("_low_noise"))
    return int(match.group(1)) if match else None


def _is_backup(folder: Path) -> bool:
    return (folder / "trainable.safetensors").is_file() and (folder / "progress.json").is_file()


def _backup_checkpoint(folder: Path) -> Checkpoint:
    """A backup of a LoRA run (refused before any model loads when it holds another method's weights)."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    method, kind = config.get("training_method", "LORA"), config.get("lora", {}).get("type", "LORA")
    if method != "LORA" or kind != "LORA":
        raise ValueError(f"{folder}: a {method} backup{f' ({kind})' if method == 'LORA' else ''}; only LoRA (and "
                         f"DoRA) backups can be compared: compare its saved file instead")
    step = json.loads((folder / "progress.json").read_text()).get("global_step")
    run = folder.parent.name
    return Checkpoint(label=f"{run}/{folder.name}" if run and run != "backup" else folder.name, step=step,
                      source=folder, backup=folder)


def _refuse_e2v(path: Path) -> None:
    """An E2V LoRA (its header records an element layout) expands the model, so no strength of it is a merge into
    the loaded base: said before any model loads."""
    from modules.model.e2v_model import E2V_CONFIG_METADATA
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as file:
            e2v = E2V_CONFIG_METADATA in (file.metadata() or {})
    except Exception:  # noqa: BLE001 - not a safetensors file: reading it says why
        return
    if e2v:
        raise ValueError(f"{path}: an Elements-to-Video LoRA (it expands the model): compare it with sample --lora, "
                         f"one strength at a time")


def find_checkpoints(sources: list[str | Path]) -> list[Checkpoint]:
    """Each source in the order given: a LoRA file; a backup folder; a folder of backups (by step); a folder of
    LoRA files (by step, then name; an A14B `_high_noise` / `_low_noise` pair is one checkpoint)."""
    checkpoints: list[Checkpoint] = []
    for source in map(Path, sources):
        if source.is_file():
            _refuse_e2v(source)
            checkpoints.append(Checkpoint(source.name.removesuffix(".safetensors"), step_from_name(source.name),
                                          source, files=[source]))
        elif source.is_dir() and _is_backup(source):
            checkpoints.append(_backup_checkpoint(source))
        elif source.is_dir():
            backups = [_backup_checkpoint(f) for f in sorted(source.iterdir()) if f.is_dir() and _is_backup(f)]
            if backups:
                checkpoints += sorted(backups, key=lambda c: (c.step or 0, c.label))
                continue
            files: dict[str, Checkpoint] = {}
            for file in sorted(source.glob("*.safetensors")):
                stem = file.name.removesuffix(".safetensors")
                pair = stem.removesuffix("_high_noise").removesuffix("_low_noise")
                # a pair is named by its common name: sample.py's loader finds both files from it
                files.setdefault(pair, Checkpoint(pair, step_from_name(pair), source,
                                                  files=[file if pair == stem else source / f"{pair}.safetensors"]))
            if not files:
                raise FileNotFoundError(f"{source}: no LoRA file (*.safetensors) and no training backup in it")
            checkpoints += sorted(files.values(), key=lambda c: (c.step is None, c.step or 0, c.label))
        else:
            raise FileNotFoundError(f"{source}: no such LoRA file or folder")
    return checkpoints


def backup_lora_weights(folder: Path) -> dict[str, LoraWeights]:
    """expert -> LoraWeights of a LoRA training backup: its peft tensors (`transformer.<module>.lora_A.default.
    weight`) with the run's lora.alpha from the backup's config.json (peft scales by alpha / rank)."""
    from safetensors.torch import load_file
    tensors = load_file(str(folder / "trainable.safetensors"))
    lora = json.loads((folder / "config.json").read_text()).get("lora", {})  # the kind: find_checkpoints
    by_expert: dict[str, dict] = {}
    for name, tensor in tensors.items():
        expert, _, rest = name.partition(".")
        by_expert.setdefault(expert, {})[rest.replace(".default.", ".")] = tensor
    weights = {}
    for expert, state in by_expert.items():
        loaded, _ = lora_from_state_dict(state)
        for module in loaded.values():
            module.alpha = float(lora.get("alpha", module.rank))
        weights[expert] = loaded
    return weights


def _run_folder(backup: Path, workspace_dir) -> Path | None:
    """The folder a run started in, from where its backup lies (<that folder>/<workspace_dir>/backup/<run>/<step>)
    when its config names the workspace relatively, as it names a relative base; None when that cannot be told."""
    if not isinstance(workspace_dir, str) or not workspace_dir or Path(workspace_dir).is_absolute():
        return None
    workspace, parts = backup.resolve().parents[2], Path(os.path.normpath(workspace_dir)).parts
    if ".." in parts or workspace.parts[-len(parts):] != parts:
        return None
    return Path(*workspace.parts[:-len(parts)])


def trained_base(checkpoint: Checkpoint) -> str | None:
    """The base model a checkpoint was trained on: its file's header (the training config this trainer records), or
    the backup's config.json; None when it records none."""
    if checkpoint.backup is not None:
        config = json.loads((checkpoint.backup / "config.json").read_text())
        base = (config.get("model") or {}).get("base_model_name")
        if not isinstance(base, str) or not base:
            return None
        started_in = _run_folder(checkpoint.backup, config.get("workspace_dir"))
        return str(started_in / base) if started_in and (started_in / base).is_dir() else base
    from modules.util.lora.formats import expert_lora_paths
    from modules.util.modelspec import trained_base_model
    file = checkpoint.files[0]
    candidates = [file] if file.is_file() else [p for p in expert_lora_paths(file) if p.is_file()]
    return next((base for base in map(trained_base_model, candidates) if base), None)
