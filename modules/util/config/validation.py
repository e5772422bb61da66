"""Checks that need the machine: paths exist, folders can be written, the device exists, the LoRA settings fit the
model's modules. They run after the schema and before any model loads, and report every problem in one ConfigError.

The model checks read the transformer's config.json and build the transformer on the meta device (module names and
layer widths, no weights, no memory), so a regex that matches nothing or a rank wider than a layer is found in a
second, not after minutes of loading and caching. A hub id (nothing local) or a single-file transformer without a
local config skips them; the loader checks again.
"""
import functools
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from modules.util.config.companion_paths import concept_companion_problems
from modules.util.config.ConfigError import ConfigError
from modules.util.config.image_encoder_source import looks_like_hub_id
from modules.util.config.path_kinds import path_problem
from modules.util.config.TrainConfig import TrainConfig
from modules.util.devices import available_devices
from modules.util.lora.targets import LoraTargetError, lora_target_names
from modules.util.safetensors_only import NotSafetensorsError, require_safetensors

log = logging.getLogger(__name__)


def check_paths(config: TrainConfig) -> None:
    """Every check of this module; raises one ConfigError listing all problems."""
    problems = path_problems(config) + device_problems(config.device) + folder_problems(config) \
        + model_problems(config)
    if problems:
        raise ConfigError(problems)


def _has_two_experts(base: Path) -> bool:
    try:
        entry = json.loads((base / "model_index.json").read_text(encoding="utf-8")).get("transformer_2")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(entry) and entry[0] is not None


def expert_file_problems(config: TrainConfig) -> list[str]:
    """A14B single files given for one expert that record the other (modules/util/expert_metadata.py)."""
    from modules.util.expert_metadata import expert_problem
    from modules.util.lora.formats import expert_lora_paths
    files = [(f"model.{part}.path", getattr(config.model, part).path, part)
             for part in ("transformer", "transformer_2")]
    init_from = config.lora.init_from
    if init_from and config.training_method.value == "LORA":
        if Path(init_from).is_file():
            # one file goes into every expert in training (only the transformer of a one-expert model)
            two_experts = _has_two_experts(Path(config.model.base_model_name))
            parts = {"high": ["transformer"], "low": ["transformer_2"],
                     "both": ["transformer", "transformer_2"]}[config.expert] if two_experts else ["transformer"]
            files += [("lora.init_from", init_from, part) for part in parts]
        else:
            files += [("lora.init_from", str(path), part)
                      for path, part in zip(expert_lora_paths(init_from), ("transformer", "transformer_2"))]
    problems = []
    for field, path, part in files:
        if path and Path(path).is_file():
            problem = expert_problem(path, part, field)
            if problem:
                problems.append(f"{field}: {problem}")
    return problems


MODEL_PARTS = ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder", "tokenizer")


def model_path_problems(config: TrainConfig) -> list[str]:
    """The model part paths (`model.<part>.path`) that are missing or no file or folder."""
    problems = []
    for part in MODEL_PARTS:
        path = getattr(config.model, part).path
        if part == "image_encoder" and config.model.allow_download and looks_like_hub_id(path):
            continue  # a hub id (train --image_encoder): fetched by the loader
        kind = path_problem(f"model.{part}.path", path, "file or folder") if path else None
        if kind:
            problems.append(kind)
    return problems


def path_problems(config: TrainConfig) -> list[str]:
    problems = []
    base = config.model.base_model_name
    if not base:
        problems.append("model.base_model_name: required, but empty: a diffusers folder or a hub id (on the "
                        "command line: --model_name DIR_OR_HUB_ID, or --config-value model.base_model_name=...)")
    elif not Path(base).is_dir() and (Path(base).exists() or not config.model.allow_download):
        problems.append(f"model.base_model_name: {base!r} is not a folder" + (
            "" if Path(base).exists() else "; a hub id needs model.allow_download=true"))
    problems += model_path_problems(config)
    for index, concept in enumerate(config.data.concepts):
        field = f"data.concepts.{index}.path"
        kind = path_problem(field, concept.path, "file or folder") if concept.enabled else None
        if kind:
            problems.append(kind)
        elif concept.enabled and Path(concept.path).is_dir() and not any(Path(concept.path).iterdir()):
            problems.append(f"{field}: {concept.path!r} is an empty folder")
        elif concept.enabled and not Path(concept.path).is_dir() and Path(concept.path).suffix.lower() != ".jsonl":
            problems.append(f"{field}: {concept.path!r} is a file; a concept is a folder or a .jsonl manifest (put "
                            f"the file in a folder and name the folder)")
        if concept.enabled:
            problems += concept_companion_problems(index, concept)
        if concept.caption_source == "prompt_file":
            field = f"data.concepts.{index}.prompt_path"
            kind = path_problem(field, concept.prompt_path, "file") if concept.prompt_path else f"{field}: empty"
            if kind:
                problems.append(f"{kind} (caption_source is 'prompt_file')")
    for field, path in (("sampling.samples_file", config.sampling.samples_file),
                        ("lora.init_from", config.lora.init_from)):
        kind = path_problem(field, path, "file") if path else None
        if kind:
            problems.append(kind)
    weight_files = [("lora.init_from", config.lora.init_from)] + [
        (f"model.{part}.path", getattr(config.model, part).path) for part in ("transformer", "transformer_2")]
    for field, path in weight_files:
        # a transformer's sharded set may be named by its index (the official release's
        # diffusion_pytorch_model.safetensors.index.json): its shards are checked when the set is read
        sharded = field.startswith("model.") and str(path).endswith(".safetensors.index.json")
        regular_or_missing = Path(path).is_file() or not Path(path).exists()  # others: said above
        if path and not Path(path).is_dir() and not sharded and regular_or_missing:
            try:
                require_safetensors(path, field)
            except NotSafetensorsError as error:
                problems.append(str(error))
    problems += expert_file_problems(config)
    allowed = {"LORA": ["COMFY_LORA", "KOHYA_LORA", "DIFFUSERS_LORA"],
               "FINE_TUNE": ["DIFFUSERS", "ORIGINAL", "ORIGINAL_FP8_SCALED"], "EMBEDDING": ["SAFETENSORS"]}[config.training_method.value]
    if config.output.format.value not in allowed:
        problems.append(f"output.format: {config.output.format.value!r} cannot hold a {config.training_method.value} "
                        f"result; allowed: {', '.join(allowed)}")
    if config.training_method.value == "LORA" and config.lora.type != "LORA" \
            and config.output.format.value == "DIFFUSERS_LORA":
        problems.append(f"output.format: DIFFUSERS_LORA has no key names for {config.lora.type} (lora.type); "
                        f"use COMFY_LORA or KOHYA_LORA")
    if config.sampling.compare_strengths and config.training_method.value != "LORA":
        problems.append(f"sampling.compare_strengths: a strength scales a LoRA; a {config.training_method.value} run "
                        f"has none (leave it empty)")
    from modules.util.lora.accelerator_files import accelerator_problems
    problems += accelerator_problems(config.sampling.accelerator)
    from modules.util.config.DistillConfig import distill_problems
    problems += distill_problems(config)
    destination = Path(config.output.destination)
    if config.output.format.value != "DIFFUSERS" and destination.is_dir():
        problems.append(f"output.destination: {str(destination)!r} is an existing folder; {config.output.format.value} "
                        f"writes a file: name the file (e.g. {str(destination / 'lora.safetensors')!r})")
    return problems


# ---- the device ----------------------------------------------------------------------------------------------------

def device_problems(device: str) -> list[str]:
    """The schema has checked the spelling (auto, cpu, cuda, cuda:N, mps); this checks the machine has it."""
    if device in ("auto", "cpu"):
        return []
    devices = available_devices()
    if device == "cuda" and any(name.startswith("cuda:") for name in devices):
        return []
    if device in devices:
        return []
    if device.startswith("cuda") and torch.version.cuda is None and torch.version.hip is None:
        why = f"this torch build ({torch.__version__}) has no CUDA support"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        why = "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
    else:
        why = "this machine has no such device"
    return [f"device: {device!r} is not available: {why}; devices here: {', '.join(devices)} (or auto)"]


# ---- folders the run writes ----------------------------------------------------------------------------------------

def folder_problem(field: str, folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot be created (if missing) and written, or None. Creates nothing."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return f"{field}: {str(folder)!r} is not a folder"
    existing = path
    while not existing.exists():  # exists() is False under a file too (/dev/null/x), so climb to what is there
        existing = existing.parent
    if not existing.is_dir():
        return f"{field}: {str(folder)!r} cannot be created: {str(existing)!r} is a file, not a folder"
    action = "written" if existing == path else "created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{field}: {str(folder)!r} cannot be {action}: no write permission in {str(existing)!r}"
    # os.access says yes to root everywhere, and to /proc or a read-only mount: a probe folder, removed at once
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".wan-trainer-probe-", dir=existing))
    except OSError as error:
        return f"{field}: {str(folder)!r} cannot be {action} in {str(existing)!r}: {error.strerror or error}"
    return None


def folder_problems(config: TrainConfig) -> list[str]:
    destination = Path(config.output.destination)
    checks = (("workspace_dir", config.workspace_dir), ("cache_dir", config.cache_dir),
              ("output.destination", destination.parent))
    return [problem for field, folder in checks if (problem := folder_problem(field, folder))]


# ---- the model's modules -------------------------------------------------------------------------------------------

def transformer_config_path(config: TrainConfig, part: str) -> Path | None:
    """The config.json of a transformer part (`transformer` or `transformer_2`) when it is on disk."""
    override = Path(getattr(config.model, part).path) if getattr(config.model, part).path else None
    candidates = []
    if override is not None and override.is_dir():
        candidates += [override / "config.json", override / part / "config.json"]
    else:  # no override, or a single file, whose config is the base model's
        candidates.append(Path(config.model.base_model_name) / part / "config.json")
    return next((path for path in candidates if path.is_file()), None)


@functools.lru_cache(maxsize=8)
def meta_transformer(config_text: str) -> torch.nn.Module:
    """The transformer class this config names (Wan's own, VACE's, Animate's), built on the meta device: no weights
    are read or allocated."""
    from modules.model.transformer_classes import transformer_class
    config = json.loads(config_text)
    with torch.device("meta"):
        return transformer_class(config).from_config(config)


def linear_layer_shapes(config_text: str) -> dict[str, tuple[int, int]]:
    """Name -> (in_features, out_features) of every Linear of the transformer."""
    return {name: (module.in_features, module.out_features)
            for name, module in meta_transformer(config_text).named_modules() if isinstance(module, torch.nn.Linear)}


def fine_tune_problems(config: TrainConfig) -> list[str]:
    """A fine-tune's expert and `fine_tune.layer_filter` against the model's parameter names (as WanFineTuneSetup
    matches them: `transformer.blocks.0.attn1.to_q.weight`), before any weight loads."""
    if config.training_method.value != "FINE_TUNE" or not Path(config.model.base_model_name).is_dir():
        return []
    two_experts = _has_two_experts(Path(config.model.base_model_name))
    if two_experts and config.expert == "both":
        return ["expert: a fine-tune trains one expert of a two-expert model; set expert to high or low"]
    filters = config.fine_tune.layer_filter
    part = "transformer_2" if two_experts and config.expert == "low" else "transformer"
    path = transformer_config_path(config, part)
    if not filters or path is None:
        return []
    try:
        names = [f"{part}.{name}" for name, _ in meta_transformer(path.read_text(encoding="utf-8")).named_parameters()]
    except Exception as error:  # noqa: BLE001  a broken config is the loader's (and wan_detection's) to report
        log.debug("fine-tune checks skipped: %s: %s", path, error)
        return []
    if any(f in name for name in names for f in filters):
        return []
    example = next((name for name in names if ".blocks.0." in name), names[0])
    return [f"fine_tune.layer_filter: {filters} matches no parameter of the {part} (checked against {path}); a filter "
            f"is a part of a parameter name, e.g. 'blocks.0.' or 'attn1' in {example!r}"]


def model_problems(config: TrainConfig) -> list[str]:
    if config.training_method.value == "FINE_TUNE":
        return fine_tune_problems(config)
    if config.training_method.value != "LORA" or not config.model.base_model_name \
            or not Path(config.model.base_model_name).is_dir():
        return []
    experts = {"high": ["transformer"], "low": ["transformer_2"]}.get(config.expert, ["transformer", "transformer_2"])
    problems = []
    for part in experts:
        path = transformer_config_path(config, part)
        if path is None:
            continue
        try:
            shapes = linear_layer_shapes(path.read_text(encoding="utf-8"))
        except Exception as error:  # noqa: BLE001  a broken config is the loader's (and wan_detection's) to report
            log.debug("model checks skipped: %s: %s", path, error)
            continue
        lora = config.lora
        try:
            targets = lora_target_names(list(shapes), lora.targets, lora.custom_targets,
                                        lora.face_adapter)
        except LoraTargetError as error:
            problems.append(f"{error} (checked against {path})")
            continue
        narrowest = min(targets, key=lambda name: min(shapes[name]))
        width = min(shapes[narrowest])
        if lora.rank > width:
            problems.append(f"lora.rank: {lora.rank} is wider than the narrowest targeted layer ({narrowest}, "
                            f"{shapes[narrowest][0]} -> {shapes[narrowest][1]}); at most {width}")
        if problems:
            break  # the experts share their module names: one report is enough
    return problems
