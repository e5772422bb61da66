"""Loading, migrating, overriding and saving TrainConfig JSON, with one clear message per problem."""
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from modules.util.atomic import atomic_write_text
from modules.util.config.TrainConfig import TrainConfig

CONFIG_VERSION = 2
VERSION_KEY = "__version"


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds one line per problem; scripts exit with code 2."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n" + "\n".join(f"  - {p}" for p in problems))


def _migrate_0_to_1(data: dict) -> dict:
    # Version 0 (unversioned) configs named the output section's path "output_model_destination" at top level,
    # as OneTrainer does.
    if "output_model_destination" in data:
        data.setdefault("output", {})["destination"] = data.pop("output_model_destination")
    if "output_model_format" in data:
        data.setdefault("output", {})["format"] = data.pop("output_model_format")
    return data


def _migrate_1_to_2(data: dict) -> dict:
    # Version 2 renamed the ambiguous timestep distribution "shift" (uniform, then shifted; also the default) to
    # "uniform_shift" and made musubi-tuner's "sigmoid_shift" the default; and "480p" (832x480 for 16:9) became the
    # default resolution where version 1 meant the area of 480 x 480. A version-1 file keeps its meaning, also where
    # it relied on the defaults.
    timestep = data.setdefault("timestep", {})
    if isinstance(timestep, dict) and timestep.get("distribution", "shift") == "shift":
        timestep["distribution"] = "uniform_shift"
    data_section = data.setdefault("data", {})
    if isinstance(data_section, dict):
        data_section.setdefault("resolution", 480)
    return data


MIGRATIONS: dict[int, Callable[[dict], dict]] = {0: _migrate_0_to_1, 1: _migrate_1_to_2}


def migrate(data: dict, source: str = "") -> dict:
    data = dict(data)
    version = data.pop(VERSION_KEY, 0)
    if not isinstance(version, int) or version < 0 or version > CONFIG_VERSION:
        raise ConfigError([f"{VERSION_KEY}: {version!r} is not a known config version (0..{CONFIG_VERSION})"], source)
    while version < CONFIG_VERSION:
        data = MIGRATIONS[version](data)
        version += 1
    return data


def read_json_object(path: str | os.PathLike, what: str = "config") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{what} file {str(path)!r} does not exist"], str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError([f"line {e.lineno} column {e.colno}: {e.msg}"], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([f"the file must hold a JSON object, not {type(data).__name__}"], str(path))
    return data


def deep_merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value`: the value is read as JSON when it parses (numbers, booleans, lists), else as a string."""
    if "=" not in text:
        raise ConfigError([f"--config-value {text!r}: expected dotted.key=value"])
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError([f"--config-value {text!r}: {key!r} is not a dotted key"])
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return parts, value


def apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        # list elements are addressed by index: data.concepts.0.path=...
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError([f"{'.'.join(parts)}: {part!r} is not a section"])
        node = node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError([f"{'.'.join(parts)}: cannot set a value inside {type(node).__name__}"])


def format_validation_error(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            problems.append(f"{field}: unknown key (value {item['input']!r})")
        elif item["type"] == "missing":
            problems.append(f"{field}: required, but missing")
        else:
            problems.append(f"{field}: {item['input']!r} is not allowed: {item['msg']}")
    return problems


def with_dataset_config(data: dict, overrides: list[tuple[list[str], Any]] = ()) -> dict:
    """The config dict with its data.dataset_config (a peer's dataset TOML, docs/data.md) read in: the file's
    settings replace the data section's, its datasets join the concepts; `overrides` are applied again after it,
    so that a --config-value still wins."""
    section = data.get("data")
    dataset_file = section.get("dataset_config") if isinstance(section, dict) else None
    if not dataset_file:
        return data
    from modules.util.config.dataset_toml import merge_dataset_settings, read_dataset_toml
    data = merge_dataset_settings(data, read_dataset_toml(dataset_file))
    for parts, value in overrides:
        apply_override(data, parts, value)
    return data


def config_from_dict(data: dict, source: str = "", read_dataset_config: bool = True) -> TrainConfig:
    data = migrate(data, source)
    if read_dataset_config:
        data = with_dataset_config(data)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e), source) from None


def load_config(config_path: str | None = None, preset_path: str | None = None,
                overrides: Iterable[str] = ()) -> TrainConfig:
    """defaults < preset (sparse) < config file < data.dataset_config's settings < --config-value overrides."""
    data: dict = {}
    sources = []
    for path in (preset_path, config_path):
        if path:
            data = deep_merge(data, migrate(read_json_object(path), path))
            sources.append(path)
    overrides = [parse_override(text) for text in overrides]
    for parts, value in overrides:
        apply_override(data, parts, value)
    data = with_dataset_config(data, overrides)
    if isinstance(data.get("data"), dict) and data["data"].get("dataset_config"):
        sources.append(str(data["data"]["dataset_config"]))
    data[VERSION_KEY] = CONFIG_VERSION
    return config_from_dict(data, " + ".join(sources) or "defaults", read_dataset_config=False)


def config_to_dict(config: TrainConfig, sparse: bool = False) -> dict:
    data = config.model_dump(mode="json", exclude_defaults=sparse)
    return {VERSION_KEY: CONFIG_VERSION, **data}


def save_config(config: TrainConfig, path: str | os.PathLike, sparse: bool = False) -> None:
    atomic_write_text(path, json.dumps(config_to_dict(config, sparse), indent=4) + "\n")
