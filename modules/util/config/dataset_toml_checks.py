"""The checks both peers' dataset TOML readers (musubi_dataset, diffusion_pipe_dataset) share: keys, paths, frame
counts, each a problem line in the caller's list, so every problem of a file is reported at once."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


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
