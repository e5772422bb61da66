"""Loading, migrating, overriding and saving TrainConfig JSON, with one clear message per problem."""
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError

from modules.util.atomic import atomic_write_text
from modules.util.config.bounds import check_usable_path
from modules.util.config.ConfigError import MAX_CONFIG_BYTES, ConfigError  # re-exported: the older import path
from modules.util.config.dataset_toml import merge_dataset_settings, read_dataset_toml
from modules.util.config.TrainConfig import TrainConfig
# re-exported: the older import paths
from modules.util.config.json_files import MAX_JSON_DEPTH, parse_json_text, read_json_file, read_json_object  # noqa: F401
from modules.util.config.validation_problems import format_validation_error, short_repr  # noqa: F401

CONFIG_VERSION = 2
VERSION_KEY = "__version"


def _migrate_0_to_1(data: dict, _named_version: bool) -> dict:
    # Version 0 (unversioned) configs named the output section's path "output_model_destination" at top level,
    # as OneTrainer does. The old keys move into the output section, which must then be an object.
    moved = {field: data.pop(key) for key, field in (("output_model_destination", "destination"),
                                                      ("output_model_format", "format")) if key in data}
    if moved:
        output = data.get("output", {})
        if not isinstance(output, dict):
            raise ConfigError([f"output: {output!r} is not allowed: must be an object (version 0 config: "
                               f"{', '.join('output_model_' + f for f in moved)} move into it)"])
        data["output"] = {**output, **moved}
    return data


def _migrate_1_to_2(data: dict, named_version: bool) -> dict:
    # Version 2 renamed the ambiguous timestep distribution "shift" (uniform, then shifted; also the default) to
    # "uniform_shift" and made musubi-tuner's "sigmoid_shift" the default; and "480p" (832x480 for 16:9) became the
    # default resolution where version 1 meant the area of 480 x 480. A file that names version 1 was written by
    # this project and keeps its meaning, also where it relied on the defaults. A file with no version is written by
    # hand (this project always writes the version): its values are renamed, but no old default is filled in, since
    # that would override the preset it is layered over.
    timestep = data.setdefault("timestep", {}) if named_version else data.get("timestep")
    if isinstance(timestep, dict) and timestep.get("distribution", "shift" if named_version else None) == "shift":
        timestep["distribution"] = "uniform_shift"
    if named_version and isinstance(data.setdefault("data", {}), dict):
        data["data"].setdefault("resolution", 480)
    return data


# each takes (data, whether the file named its version)
MIGRATIONS: dict[int, Callable[[dict, bool], dict]] = {0: _migrate_0_to_1, 1: _migrate_1_to_2}


def migrate(data: dict, source: str = "") -> dict:
    data = dict(data)
    named_version = VERSION_KEY in data
    version = data.pop(VERSION_KEY, 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0 or version > CONFIG_VERSION:
        raise ConfigError([f"{VERSION_KEY}: {short_repr(version)} is not a known config version "
                           f"(0..{CONFIG_VERSION})"], source)
    while version < CONFIG_VERSION:
        try:
            data = MIGRATIONS[version](data, named_version)
        except ConfigError as error:
            raise ConfigError(error.problems, source) from None
        version += 1
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
        return parts, parse_json_text(raw, key.strip(), not_json_as_text=True)
    except ConfigError as error:
        raise ConfigError([f"{key.strip()}: {problem}" for problem in error.problems]) from None


def _list_index(node: list, part: str, dotted: str) -> int:
    # ASCII digits only: str.isdigit() is true for '²' and other characters int() refuses
    if not (part.isascii() and part.isdigit()):
        raise ConfigError([f"{dotted}: {part!r} is not an index of the list; list items are addressed by number "
                           f"(0..{len(node) - 1})" if node else f"{dotted}: {part!r} addresses an item of an "
                           f"empty list"])
    if int(part) >= len(node):
        raise ConfigError([f"{dotted}: index {part} is past the end of the list ({len(node)} item(s))"])
    return int(part)


def apply_override(data: dict, parts: list[str], value: Any) -> None:
    dotted = ".".join(parts)
    node = data
    for part in parts[:-1]:
        # list elements are addressed by index: data.concepts.0.path=...
        if isinstance(node, list):
            node = node[_list_index(node, part, dotted)]
            continue
        if not isinstance(node, dict):
            raise ConfigError([f"{dotted}: {part!r} is not a section"])
        node = node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, dotted)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError([f"{dotted}: cannot set a value inside {type(node).__name__}"])


def with_dataset_config(data: dict, overrides: list[tuple[list[str], Any]] = ()) -> dict:
    """The config dict with its data.dataset_config (a peer's dataset TOML, docs/data.md) read in: the file's
    settings replace the data section's, its datasets join the concepts; `overrides` are applied again after it,
    so that a --config-value still wins."""
    section = data.get("data")
    dataset_file = section.get("dataset_config") if isinstance(section, dict) else None
    if not dataset_file or not isinstance(dataset_file, str):
        return data  # a value of the wrong type is the schema's to report
    try:
        check_usable_path(dataset_file)
    except ValueError as error:
        raise ConfigError([f"data.dataset_config: {error}"]) from None
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
    problems, applied = [], []
    for text in overrides:  # every bad override and every schema problem are reported together
        try:
            parts, value = parse_override(text)
            apply_override(data, parts, value)
            applied.append((parts, value))
        except ConfigError as error:
            problems += error.problems
    try:
        data = with_dataset_config(data, applied)
    except ConfigError as error:
        raise ConfigError(problems + error.problems, error.source) from None
    if isinstance(data.get("data"), dict) and data["data"].get("dataset_config"):
        sources.append(str(data["data"]["dataset_config"]))
    data[VERSION_KEY] = CONFIG_VERSION
    # a value set on the command line is named as such: naming only the preset sent users to a file they never edited
    source = " + ".join(sources + (["command-line values"] if applied else [])) or "defaults"
    try:
        config = config_from_dict(data, source, read_dataset_config=False)
    except ConfigError as error:
        raise ConfigError(problems + error.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return config


def config_to_dict(config: TrainConfig, sparse: bool = False) -> dict:
    data = config.model_dump(mode="json", exclude_defaults=sparse)
    return {VERSION_KEY: CONFIG_VERSION, **data}


def save_config(config: TrainConfig, path: str | os.PathLike, sparse: bool = False) -> None:
    atomic_write_text(path, json.dumps(config_to_dict(config, sparse), indent=4) + "\n")
