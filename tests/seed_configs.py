"""The E2V JSON of the user's notes, from two places: the user's own seeds (`../shared/seeds/NNN_*.txt`, the first
```json block), present only beside the development checkout, and the project's fixtures (`tests/fixtures/`), the
same three forms (nested 000 and 001, flat 002) kept with the project so that a user's clone tests them too."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SEEDS = ROOT.parent / "shared" / "seeds"


def fixture_text(number: str) -> str:
    return (FIXTURES / f"seed_{number}_e2v.json").read_text(encoding="utf-8")


def user_seed_path(number: str) -> Path | None:
    return next(iter(sorted(SEEDS.glob(f"{number}_*.txt"))), None) if SEEDS.is_dir() else None


def user_seed_text(number: str) -> str:
    """The JSON block of the user's seed, as written; skips the test when the seeds are not beside this checkout."""
    path = user_seed_path(number)
    if path is None:
        pytest.skip(f"the user's notes ({SEEDS}/{number}_*.txt) are not beside this checkout; "
                    f"tests/fixtures/seed_{number}_e2v.json covers the same JSON form")
    match = re.search(r"```json\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
    assert match, f"{path} holds no ```json block"
    return match.group(1)


def with_data_root(text: str, data_root: str | Path) -> str:
    """The JSON text with only its data_root value replaced (the text is otherwise kept as written)."""
    replaced, count = re.subn(r'("data_root"\s*:\s*)"[^"]*"', lambda m: m.group(1) + json.dumps(str(data_root)),
                              text)
    assert count >= 1, "no data_root in the config"
    return replaced
