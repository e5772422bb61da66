"""What the window remembers between sessions, beside the last-used config (workspace/ui/prefs.json): its size and
position, dark or light, whether a run has been made (the first-run hint), and the run that was interrupted by
closing the window (offered for resuming on the next start). Imports no toolkit."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from modules.util.atomic import atomic_write_text

DEFAULT_GEOMETRY = "1280x900"


@dataclass
class UIPrefs:
    geometry: str = DEFAULT_GEOMETRY
    appearance: str = "dark"            # "dark" or "light"
    has_run: bool = False               # a run was started from this window once: no first-run hint
    interrupted_config: str = ""        # the run config (run-configs/) of a run stopped by closing the window
    log_level: str = "INFO"             # the log panel's filter

    @classmethod
    def read(cls, path: Path) -> "UIPrefs":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls()
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known}) if isinstance(data, dict) else cls()

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")


def fit_geometry(geometry: str, screen_width: int, screen_height: int) -> str:
    """A remembered "WxH+X+Y" made to fit the screen it opens on (a window saved on a larger monitor would open
    cut off or out of reach): the size at most the screen's, the place so the whole window is on it. An unreadable
    value gives the default size."""
    import re
    match = re.fullmatch(r"(\d+)x(\d+)(?:([+-]-?\d+)([+-]-?\d+))?", geometry.strip())
    if not match:
        geometry, match = DEFAULT_GEOMETRY, re.fullmatch(r"(\d+)x(\d+)", DEFAULT_GEOMETRY)
    width = max(400, min(int(match.group(1)), screen_width))
    height = max(300, min(int(match.group(2)), screen_height))
    if match.lastindex and match.lastindex >= 4:
        x = min(max(0, int(match.group(3).replace("+-", "-"))), max(0, screen_width - width))
        y = min(max(0, int(match.group(4).replace("+-", "-"))), max(0, screen_height - height))
        return f"{width}x{height}+{x}+{y}"
    return f"{width}x{height}"


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def line_level(line: str) -> str:
    """A log line's level by its first word ("WARNING root: ..."), ERROR for a traceback; the window's own messages
    count as INFO."""
    word = line.split(" ", 1)[0]
    if line.startswith("Traceback "):
        return "ERROR"
    return word if word in LEVELS else ("ERROR" if word == "CRITICAL" else "INFO")


def level_shown(level: str, shown_from: str) -> bool:
    """Whether a message of `level` shows in a pane filtered to `shown_from` and above."""
    return LEVELS.index(level) >= LEVELS.index(shown_from if shown_from in LEVELS else "INFO")


def shown_at(line: str, level: str) -> bool:
    return level_shown(line_level(line), level)
