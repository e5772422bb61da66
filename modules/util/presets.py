"""The shipped presets (training_presets/*.json), found by path or by name: `--preset-path "wan 2.1 1.3B LoRA 24GB"`
works with or without the leading '#' and the '.json', in any letter case."""
import json
from pathlib import Path

from modules.util.config.config_io import ConfigError
from modules.util.enum.WanVariant import WanVariant

PRESET_DIR = Path(__file__).resolve().parents[2] / "training_presets"


def preset_name(path: Path) -> str:
    return path.stem.removeprefix("#")


def _key(text: str) -> str:
    text = text.strip()
    text = text[:-len(".json")] if text.lower().endswith(".json") else text
    return " ".join(text.removeprefix("#").lower().split())


def shipped_presets() -> list[Path]:
    return sorted(PRESET_DIR.glob("*.json"), key=lambda p: _key(p.name))


def resolve_preset(text: str) -> str:
    """A preset file: `text` when it names an existing file, else the shipped preset of that name."""
    if Path(text).is_file():
        return text
    wanted = _key(Path(text).name)
    for path in shipped_presets():
        if _key(path.name) == wanted:
            return str(path)
    names = "\n".join(f"    {preset_name(p)}" for p in shipped_presets())
    raise ConfigError([f"--preset-path {text!r}: no such file, and no shipped preset has that name; the presets "
                       f"(train.py --list-presets):\n{names}"])


def intended_variant(path: Path) -> WanVariant | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("intended_variant")
    except (OSError, ValueError, AttributeError):
        return None
    return WanVariant(value) if value in WanVariant._value2member_map_ else None


def presets_for_variant(variant: WanVariant) -> list[str]:
    return [preset_name(p) for p in shipped_presets() if intended_variant(p) is variant]


def presets_table() -> str:
    """One line per shipped preset: its name and the variant it is made for (docs/presets.md says more)."""
    paths = shipped_presets()
    width = max(len(preset_name(p)) for p in paths)
    lines = [f"{'preset'.ljust(width)}  made for"]
    for path in paths:
        variant = intended_variant(path)
        lines.append(f"{preset_name(path).ljust(width)}  {variant.value if variant else 'any'}")
    lines.append(f"(in {PRESET_DIR}; pass a name or a path to --preset-path)")
    return "\n".join(lines)
