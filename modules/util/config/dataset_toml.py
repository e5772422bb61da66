"""Peers' dataset files (musubi-tuner's and diffusion-pipe's dataset TOML) read into this trainer's settings.

`read_dataset_toml(path)` returns a sparse TrainConfig dict: `data.concepts` (one concept per dataset or
directory) and the data settings the file states (`data.resolution`, `data.aspect_ratios`, `data.frame_buckets`,
`data.no_upscale`, and `batch_size`). Keys this trainer cannot honour are refused: one ConfigError naming the file,
every such key and the supported ones. docs/data.md lists the mapping key by key.

Relative paths in the file are used as written, i.e. from the current directory, as both peers read them.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from pathlib import Path

from modules.util.text_encoding import decode_with_bom
from modules.util.config.ConfigError import MAX_CONFIG_BYTES, ConfigError
from modules.util.config.path_kinds import path_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)


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


# refused keys whose 0 means off (diffusion-pipe: "0 to keep original caption")
OFF_AT_ZERO = {"cache_shuffle_num"}


def check_keys(table: dict, where: str, supported: Iterable[str], refused: dict[str, str],
               problems: list[str], label: str) -> None:
    """One problem per key that is refused (with why) or unknown, then one line naming the keys `label` (the
    table's name) supports."""
    supported = sorted(supported)
    # a refused feature written as off (`alpha_mask = false`, `cache_shuffle_num = 0`: templates spell out their
    # defaults) asks for nothing this trainer does not do
    bad = [key for key in table if key not in supported
           and not (key in refused and (table[key] is False or table[key] in ("", [])
                                        or (key in OFF_AT_ZERO and table[key] == 0)))]
    for key in bad:
        problems.append(f"{where}{key}: " + (f"not supported here: {refused[key]}" if key in refused
                                             else "unknown key"))
    summary = f"supported keys in {label}: {', '.join(supported)}"
    if bad and summary not in problems:
        problems.append(summary)


def check_exists(value, where: str, problems: list[str], want_file: bool = False) -> None:
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: {value!r} is not a path")
    elif not (Path(value).is_file() if want_file else Path(value).is_dir()):
        kind = "file" if want_file else "folder"
        problems.append(f"{where}: {value!r} is not a {kind} (relative paths are read from the current directory, "
                        f"{Path.cwd()})")


def round_frames(values, where: str, problems: list[str]) -> list[int]:
    """Frame counts rounded down to 4k+1 (as musubi-tuner does), with a notice when one changed."""
    if not isinstance(values, list) or not values or not all(isinstance(v, int) and v >= 1 for v in values):
        problems.append(f"{where}: {values!r} is not a list of positive whole frame counts")
        return []
    rounded = sorted({(v - 1) // 4 * 4 + 1 for v in values})
    if rounded != sorted(set(values)):
        log.warning("%s: frame counts %s rounded down to 4k+1: %s (Wan takes 4k+1 frames)", where, values, rounded)
    return rounded


def read_dataset_toml(path: str | Path) -> dict:
    """The file's kind is told by its tables: `[[datasets]]` is musubi-tuner's, `[[directory]]` diffusion-pipe's."""
    table = load_toml(path)
    if "datasets" in table:
        from modules.util.config.musubi_dataset import musubi_settings
        return musubi_settings(table, str(path))
    if "directory" in table:
        from modules.util.config.diffusion_pipe_dataset import diffusion_pipe_settings
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
