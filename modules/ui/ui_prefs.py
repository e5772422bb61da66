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


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def line_level(line: str) -> str:
    """A log line's level by its first word ("WARNING root: ..."); the window's own messages count as INFO."""
    word = line.split(" ", 1)[0]
    return word if word in LEVELS else ("ERROR" if word == "CRITICAL" else "INFO")


def shown_at(line: str, level: str) -> bool:
    return LEVELS.index(line_level(line)) >= LEVELS.index(level if level in LEVELS else "INFO")
