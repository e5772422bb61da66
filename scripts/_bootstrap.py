"""Imported first by every script: puts the repository root on sys.path so `modules` imports."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from modules.util.known_warnings import hide_known_warnings  # noqa: E402

hide_known_warnings()
