"""The command-line spellings of the user's LoRA workflow notes (seed 004: `training/train_lora.py` and
`scripts/generate.py`), accepted by scripts/train.py and scripts/sample.py and mapped to this project's own.

train: --manifest, --max_steps, --batch_size, --gradient_accumulation_steps, --num_epochs, --learning_rate,
--save_steps (its --output_dir is seed 001's, in train.py). --num_epochs without --max_steps trains that many
epochs (max_steps 0, over a preset's cap). sample: --lora_weights (a LoRA file or the folder
train's --output_dir wrote), --num_videos, --output (one MP4), --output_dir.
"""
import argparse
import json
from pathlib import Path

# option -> (dotted config key, type)
TRAIN_OPTIONS = {
    "max_steps": ("max_steps", int),
    "batch_size": ("batch_size", int),
    "gradient_accumulation_steps": ("optimizer.gradient_accumulation_steps", int),
    "num_epochs": ("epochs", int),
    "learning_rate": ("optimizer.learning_rate", float),
    "save_steps": ("backup.save_every_n_steps", int),
}

# the LoRA file a folder holds, in this order: train --output_dir's names, then peft's and diffusers' own
LORA_FILE_NAMES = ("lora.safetensors", "e2v_lora.safetensors", "adapter_model.safetensors",
                   "pytorch_lora_weights.safetensors")


def add_train_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA workflow notes (seed 004); --config-value wins")
    group.add_argument("--manifest", metavar="JSONL", help="a .jsonl manifest (media path and prompt a line): the "
                       "only concept (data.concepts)")
    for option, (key, kind) in TRAIN_OPTIONS.items():
        group.add_argument(f"--{option}", f"--{option.replace('_', '-')}", dest=option, type=kind, help=key)


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The seed-004 options given, as dotted overrides."""
    values = []
    if args.manifest:
        values.append("data.concepts=" + json.dumps([{"name": Path(args.manifest).stem, "path": args.manifest}]))
    for option, (key, _) in TRAIN_OPTIONS.items():
        if getattr(args, option) is not None:
            values.append(f"{key}={getattr(args, option)}")
    if args.num_epochs is not None and args.max_steps is None:
        values.append("max_steps=0")  # the notes' --num_epochs alone means that many epochs, not a preset's cap
    return values


def add_sample_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA workflow notes (seed 004)")
    group.add_argument("--lora_weights", "--lora-weights", action="append", default=[], metavar="PATH[:STRENGTH]",
                       help="as --lora; a folder means the LoRA file train --output_dir wrote in it "
                            f"({', '.join(LORA_FILE_NAMES)})")
    group.add_argument("--output", metavar="FILE.mp4", help="write the one video to this file (several videos: "
                       "FILE-1.mp4, FILE-2.mp4, ...)")


def lora_in_folder(folder: Path) -> Path:
    """The LoRA file of a folder given as --lora_weights; ValueError naming what it holds when there is none."""
    for name in LORA_FILE_NAMES:
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    raise ValueError(f"--lora_weights {str(folder)!r} is a folder without one LoRA file: expected one of "
                     f"{', '.join(LORA_FILE_NAMES)}" + (f"; it holds {', '.join(p.name for p in found)}: name one"
                                                        if found else ""))


def output_file_names(output: str, written: list[Path]) -> list[Path]:
    """Where --output puts the videos written: the file itself for one, numbered beside it for several."""
    target = Path(output)
    if target.suffix.lower() != ".mp4":
        target = target.with_name(target.name + ".mp4")
    if len(written) == 1:
        return [target]
    return [target.with_name(f"{target.stem}-{k}{target.suffix}") for k in range(1, len(written) + 1)]
