"""Peers' dataset files (musubi-tuner's and diffusion-pipe's dataset TOML) read into this trainer's settings.

`read_dataset_toml(path)` returns a sparse TrainConfig dict: `data.concepts` (one concept per dataset or
directory) and the data settings the file states (`data.resolution`, `data.aspect_ratios`, `data.frame_buckets`,
`data.no_upscale`, and `batch_size`). Keys this trainer cannot honour are refused: one ConfigError naming the file,
every such key and the supported ones. docs/data.md lists the mapping key by key.

Relative paths in the file are used as written, i.e. from the current directory, as both peers read them.
"""
from __future__ import annotations

import sys
from pathlib import Path

from modules.util.text_encoding import decode_with_bom
from modules.util.config.ConfigError import MAX_CONFIG_BYTES, ConfigError
from modules.util.config.diffusion_pipe_dataset import diffusion_pipe_settings
from modules.util.config.musubi_dataset import musubi_settings
from modules.util.config.path_kinds import path_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir() or path.suffix.lower() == ".jsonl":
        raise ConfigError([f"data.dataset_config: {str(path)!r} is a {'folder' if path.is_dir() else 'manifest'}, "
                           f"not a dataset TOML; give it as a concept instead: "
                           f"--config-value 'data.concepts=[{{\"path\": \"{path}\"}}]'"], str(path))
    if not path.is_file():
        problem = path_problem("data.dataset_config", str(path), "file")
        raise ConfigError([problem + (f" (relative paths are read from the current directory, {Path.cwd()})"
                                      if not path.exists() else "")], str(path))
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError([f"data.dataset_config: {path.stat().st_size} bytes; a dataset TOML is at most "
                           f"{MAX_CONFIG_BYTES}"], str(path))
    try:
        raw = path.read_bytes()
        text = decode_with_bom(raw, path)  # a byte-order mark names the encoding; without one, UTF-8
        return tomllib.loads(raw.decode("utf-8") if text is None else text)
    except RecursionError:
        raise ConfigError(["nested too deeply"], str(path)) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError([f"not valid TOML: {error}"], str(path)) from None
    except OSError as error:  # a device or pseudo file (/proc/self/mem) that stat calls a file
        raise ConfigError([f"data.dataset_config: {str(path)!r} cannot be read: {error.strerror or error}"],
                          str(path)) from None
    except UnicodeDecodeError as error:
        raise ConfigError([f"not UTF-8 text: {error}"], str(path)) from None


def read_dataset_toml(path: str | Path) -> dict:
    """The file's kind is told by its tables: `[[datasets]]` is musubi-tuner's, `[[directory]]` diffusion-pipe's."""
    table = load_toml(path)
    if "datasets" in table:
        return musubi_settings(table, str(path))
    if "directory" in table:
        return diffusion_pipe_settings(table, str(path))
    raise ConfigError(["neither a musubi-tuner dataset config ([[datasets]] tables) nor a diffusion-pipe one "
                       "([[directory]] tables)"], str(path))


def merge_dataset_settings(data: dict, settings: dict) -> dict:
    """The config dict with the dataset file's settings in place of its own and the file's concepts after the
    config's concepts."""
    merged = dict(data)
    section = dict(merged.get("data") or {})
    concepts = list(section.get("concepts") or [])
    if settings.get("data", {}).get("concepts"):
        # the user's dataset replaces the demo preset's squares instead of training mixed with them
        from modules.util.demo_paths import is_demo_concept
        concepts = [c for c in concepts if not (isinstance(c, dict) and is_demo_concept(c.get("name"), c.get("path", "")))]
    # a config saved after loading already holds the file's concepts (by name and path): not added twice
    present = {(c.get("name"), c.get("path")) for c in concepts if isinstance(c, dict)}
    concepts += [c for c in settings.get("data", {}).get("concepts", []) if (c["name"], c["path"]) not in present]
    section.update({k: v for k, v in settings.get("data", {}).items() if k != "concepts"})
    section["concepts"] = concepts
    merged["data"] = section
    merged.update({k: v for k, v in settings.items() if k != "data"})
    return merged
