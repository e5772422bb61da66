"""The E2V layout a LoRA or model folder records (modules/model/e2v_file_metadata.py), read for sampling: the file
alone is enough; an `--e2v-config` given as well must agree with it, or sampling stops naming every difference."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from modules.model.e2v_file_metadata import BASE_IMAGE_ENCODER, E2V_CONFIG_FILE, E2V_IMAGE_ENCODER_METADATA
from modules.model.e2v_model import E2V_CONFIG_METADATA, e2v_config_metadata
from modules.util.config.E2VConfig import E2VDatasetConfig, load_e2v_dataset_configs


@dataclass
class RecordedLayout:
    layout: dict              # the E2V dataset config as e2v_config_metadata writes it (no data_root)
    image_encoder: str        # "base", a folder, a hub id, or "" (none recorded)
    source: str               # the file that records it

    def dataset_config(self) -> E2VDatasetConfig:
        return E2VDatasetConfig.model_validate({**self.layout, "data_root": "."})


def _header(path: Path) -> dict[str, str]:
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as file:
            return file.metadata() or {}
    except Exception:  # noqa: BLE001 - not a readable safetensors file: applying it says why
        return {}


def recorded_layout(base_model_name: str, lora_paths: list[Path]) -> RecordedLayout | None:
    """The layout of the first LoRA whose header holds one, else of the base folder's e2v_config.json."""
    for path in lora_paths:
        header = _header(path) if Path(path).is_file() else {}
        if E2V_CONFIG_METADATA in header:
            return RecordedLayout(json.loads(header[E2V_CONFIG_METADATA]),
                                  header.get(E2V_IMAGE_ENCODER_METADATA, ""), str(path))
    folder_config = Path(base_model_name) / E2V_CONFIG_FILE
    if folder_config.is_file():
        dataset = load_e2v_dataset_configs(str(folder_config))[0]
        return RecordedLayout(json.loads(e2v_config_metadata(dataset)), BASE_IMAGE_ENCODER, str(folder_config))
    return None


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return {k: v for index, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{index}.").items()}
    return {prefix.rstrip("."): value}


def layout_differences(given: E2VDatasetConfig, recorded: RecordedLayout) -> list[str]:
    """One line per field where `given` (an --e2v-config) and the recorded layout differ."""
    mine, theirs = _flatten(json.loads(e2v_config_metadata(given))), _flatten(recorded.layout)
    return [f"{key}: --e2v-config has {mine.get(key, '(absent)')!r}, {recorded.source} has "
            f"{theirs.get(key, '(absent)')!r}" for key in sorted(set(mine) | set(theirs))
            if mine.get(key) != theirs.get(key)]


def _suffix_word(suffix: str) -> str:
    """`_person.png` -> `person`: what a user calls the element whose files end so."""
    return Path(suffix).stem.strip("_-. ")


def element_arguments(config: E2VDatasetConfig, elements: dict[str, str], source: str) -> tuple[dict[str, str],
                                                                                               list[str]]:
    """--element NAME=PATH by the layout's names: a name, or the word of one of its suffixes (seed 001's
    main_subject is found by `_person.png`, so `person` names it). (elements by name, notes for the words used);
    ConfigError naming every unknown or doubled element and the names that work."""
    from modules.util.config.config_io import ConfigError
    order = config.elements_in_position_order()
    words: dict[str, str] = {}
    for element in order:
        for suffix in element.suffixes:
            words.setdefault(_suffix_word(suffix), element.name)
    by_name = {element.name: element for element in order}
    resolved, notes, problems = {}, [], []
    for given, path in elements.items():
        name = given if given in by_name else words.get(given)
        if name is None:
            problems.append(f"--element {given}: the E2V layout {source} records has no such element")
        elif name in resolved:
            problems.append(f"--element {given}: the element {name!r} is given twice")
        else:
            resolved[name] = path
            if name != given:
                notes.append(f"--element {given}: the element {name!r} (its files end in "
                             f"{', '.join(s for s in by_name[name].suffixes if _suffix_word(s) == given)})")
    if problems:
        choices = "; ".join(f"{element.name} (or {', '.join(w for w, n in words.items() if n == element.name)})"
                            for element in order)
        raise ConfigError(problems + [f"its elements: {choices}"])
    return resolved, notes
