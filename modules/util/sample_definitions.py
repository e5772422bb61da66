"""Sample definitions: the samples JSON file (a list of SampleConfig objects) and musubi-tuner style prompt files.

A prompt file holds one sample a line, the prompt followed by musubi-tuner's inline options (its
`line_to_prompt_dict` / `parse_prompt_line`: the line is split at " --", each part is an option letter, a space and
its value); empty lines and lines starting with # are skipped:

    a red square moving left --w 832 --h 480 --f 81 --s 30 --g 5.0 --d 42 --fs 3.0 --n blurry --i first.png

| option      | field           | musubi-tuner meaning                                                        |
|-------------|-----------------|-----------------------------------------------------------------------------|
| --w N       | width           | width                                                                       |
| --h N       | height          | height                                                                      |
| --f N       | frames          | frame count                                                                 |
| --d N       | seed            | seed                                                                        |
| --s N       | steps           | sampling steps (clamped to 1..1000 as musubi-tuner does)                    |
| --g X       | guidance        | guidance scale (Wan has no embedded guidance: both --g and --l are CFG, as  |
| --l X       | guidance        |   in musubi-tuner's wan_generate_video)                                     |
| --fs X      | flow_shift      | discrete flow shift                                                         |
| --n TEXT    | negative_prompt | negative prompt (the rest of the part, spaces included)                     |
| --i PATH    | image           | first-frame image                                                           |
| --ei PATH   | last_image      | end (last-frame) image                                                      |
| --g2 X      | guidance_2      | ours: low-noise expert guidance of Wan 2.2 A14B                             |
| --cn PATH   | control_video   | control video (VACE, Wan-Fun Control)                                       |

musubi-tuner options for features we do not have (one-frame --of / --ci / --cim, output name
--o, CFG schedule --cs, and the audio / reference ones of other architectures) are ignored with a warning; any
other option is an error (a typo must not silently change nothing). Option names are case-insensitive.

Relative image, control, mask and reference paths are resolved against the samples file's folder when the file
(or frames folder) exists there.
"""
import json
import logging
import os
from pathlib import Path

from pydantic import ValidationError

from modules.util.config.SampleConfig import SampleConfig
from modules.util.text_encoding import read_text_file

logger = logging.getLogger(__name__)

# musubi-tuner inline option -> (SampleConfig field, type)
PROMPT_LINE_OPTIONS: dict[str, tuple[str, type]] = {
    "w": ("width", int), "h": ("height", int), "f": ("frames", int), "d": ("seed", int), "s": ("steps", int),
    "g": ("guidance", float), "l": ("guidance", float), "fs": ("flow_shift", float), "n": ("negative_prompt", str),
    "i": ("image", str), "ei": ("last_image", str), "g2": ("guidance_2", float),
    "cn": ("control_video", str),   # musubi-tuner's control video (its `control_video_path`)
}
# musubi-tuner options whose features this trainer does not have: accepted and ignored with a warning
IGNORED_PROMPT_LINE_OPTIONS = frozenset({"ci", "cim", "of", "o", "cs", "fsa", "ofps", "skb", "rj", "ref"})
# relative to the samples file; a control may be a folder of frames
_PATH_FIELDS = ("image", "last_image", "control_video", "mask_video", "reference_image", "pose_video", "face_video",
                "background_video", "driving_video")


class SampleDefinitionError(ValueError):
    pass


def parse_prompt_line(line: str) -> SampleConfig:
    """One musubi-tuner style prompt line -> SampleConfig (only the options given are set explicitly)."""
    parts = line.strip().split(" --")
    values: dict = {"prompt": parts[0].strip()}
    for part in parts[1:]:
        if not part.strip():
            continue
        option, _, value = part.strip().partition(" ")
        option, value = option.lower(), value.strip()
        if option in IGNORED_PROMPT_LINE_OPTIONS:
            logger.warning("prompt option --%s is not supported by this trainer and is ignored", part.strip())
            continue
        if option not in PROMPT_LINE_OPTIONS:
            raise SampleDefinitionError(f"unknown prompt option --{option} in {line.strip()!r}; known: "
                                        f"{', '.join('--' + o for o in PROMPT_LINE_OPTIONS)}")
        name, kind = PROMPT_LINE_OPTIONS[option]
        if not value:
            raise SampleDefinitionError(f"prompt option --{option} has no value in {line.strip()!r}")
        try:
            converted = kind(value)
        except ValueError:
            raise SampleDefinitionError(f"prompt option --{option}: {value!r} is not a valid {kind.__name__} "
                                        f"(in {line.strip()!r})") from None
        if name == "steps":
            converted = max(1, min(1000, converted))
        values[name] = converted
    try:
        return SampleConfig(**values)
    except ValidationError as error:
        raise SampleDefinitionError(f"prompt line {line.strip()!r}: {error}") from None


def parse_prompt_lines(text: str) -> list[SampleConfig]:
    return [parse_prompt_line(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def parse_samples_json(text: str, source: str = "samples JSON") -> list[SampleConfig]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SampleDefinitionError(f"{source}: not valid JSON: {error}") from None
    if isinstance(data, dict) and set(data) == {"samples"}:
        data = data["samples"]
    if not isinstance(data, list):
        raise SampleDefinitionError(f"{source}: expected a list of sample objects, got {type(data).__name__}")
    samples = []
    for index, item in enumerate(data):
        if not isinstance(item, dict):
            raise SampleDefinitionError(f"{source}: sample {index} is a {type(item).__name__}, not an object")
        try:
            samples.append(SampleConfig(**item))
        except ValidationError as error:
            raise SampleDefinitionError(f"{source}: sample {index}: {error}") from None
    return samples


def is_samples_json(path: str | os.PathLike, text: str) -> bool:
    """A `.json` file, or any other file whose content starts with [ or { (a prompt never does in practice)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return True
    if suffix == ".txt":
        return False
    return text.lstrip().startswith(("[", "{"))


def _resolve_paths(sample: SampleConfig, base: Path) -> SampleConfig:
    update = {}
    for name in _PATH_FIELDS:
        value = getattr(sample, name)
        if value and not Path(value).is_absolute() and (base / value).exists():
            update[name] = str(base / value)
    references = [str(base / v) if v and not Path(v).is_absolute() and (base / v).is_file() else v
                  for v in sample.reference_images]
    if references != list(sample.reference_images):
        update["reference_images"] = references
    elements = {k: str(base / v) if v and not Path(v).is_absolute() and (base / v).is_file() else v
                for k, v in sample.elements.items()}
    if elements != sample.elements:
        update["elements"] = elements
    return sample.model_copy(update=update) if update else sample


def load_sample_definitions(path: str | os.PathLike) -> list[SampleConfig]:
    """Every sample in a samples JSON file or a prompt file (disabled ones included: filter on `enabled`)."""
    path = Path(path)
    if not path.is_file():
        raise SampleDefinitionError(f"samples file {str(path)!r} does not exist")
    try:
        text = read_text_file(path)  # a prompt file from Notepad may be UTF-16
    except OSError as error:
        raise SampleDefinitionError(f"samples file {str(path)!r} cannot be read: {error}") from None
    samples = parse_samples_json(text, str(path)) if is_samples_json(path, text) else parse_prompt_lines(text)
    return [_resolve_paths(sample, path.parent) for sample in samples]


def save_samples_json(samples: list[SampleConfig], path: str | os.PathLike) -> None:
    """Writes samples as a JSON list (every field, so the file documents itself)."""
    from modules.util.atomic import atomic_write_text

    atomic_write_text(path, json.dumps([s.model_dump(mode="json") for s in samples], indent=2,
                                       ensure_ascii=False) + "\n")
