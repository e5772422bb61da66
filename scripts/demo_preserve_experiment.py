"""Trains the demo's LoRA ("left" / "right") in `distill.mode` `base` and `preserve` with the demo accelerator at a
strength, each at the same config seeds, then samples each LoRA with the accelerator at the given steps and
strengths for the demo's 6 captions at seeds 0 to 3 and counts the clips that pass `caption_square_problems`
(docs/distilled.md, "A harder case: a stronger accelerator", records what it measured).

  demo_preserve_experiment.py --work /tmp/preserve --seeds 42 1 --strength 2 --measure 4:2,2:2,1:2,4:1,1:1

`--strength` is the accelerator's strength while `preserve` trains (the strength it is meant to be sampled at);
`--preserve-weight` sets `distill.preserve_weight` for the preserve runs; `--measure` lists steps:strength
pairs to sample at. A LoRA already trained in `--work` is measured again, not
trained again. One thread; a `base` run takes about a minute of CPU, a `preserve` run about two.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import _bootstrap  # noqa: F401

LORA = Path("workspace") / "demo" / "output" / "demo_lora.safetensors"
MODEL = Path("workspace") / "demo" / "tiny-wan2.1-t2v"
ACCELERATOR = Path("resources") / "demo" / "demo_accelerator.safetensors"


def train_demo(work: Path, model_folder: Path, accelerator: Path, mode: str, seed: int, strength: float,
               preserve_weight: float | None = None) -> Path:
    """`train --preset-path "demo tiny CPU"` in `work` (previews off: they do not change training), in `mode`;
    the LoRA's path."""
    import train
    if (work / LORA).is_file():
        return work / LORA
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(model_folder, work / MODEL)
    (work / ACCELERATOR).parent.mkdir(parents=True)
    shutil.copy(accelerator, work / ACCELERATOR)
    values = ["sampling.every_n_steps=0", "sampling.sample_before_training=false", f"seed={seed}"]
    if mode == "preserve":
        values += ["distill.mode=preserve", f"sampling.accelerator.file={ACCELERATOR}",
                   f"sampling.accelerator.strength={strength}"]
        if preserve_weight is not None:
            values.append(f"distill.preserve_weight={preserve_weight}")
    arguments = ["--preset-path", "demo tiny CPU"]
    for value in values:
        arguments += ["--config-value", value]
    before = os.getcwd()
    os.chdir(work)
    try:
        if train.main(arguments) != 0:
            raise RuntimeError(f"the demo's {mode} run in {work} failed")
    finally:
        os.chdir(before)
    return work / LORA


def main(argv: list[str] | None = None) -> int:
    from modules.util.demo_accelerator import ACCELERATOR_FILE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a folder for the runs (kept, to measure again)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1], help="the training config's seeds")
    parser.add_argument("--strength", type=float, default=2.0, help="the accelerator's strength in preserve")
    parser.add_argument("--preserve-weight", type=float, default=None,
                        help="distill.preserve_weight of the preserve runs (default: the config's, 0.5)")
    parser.add_argument("--measure", default="4:2,2:2,1:2", help="steps:strength pairs to sample at")
    parser.add_argument("--accelerator", type=Path, default=ACCELERATOR_FILE)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import torch
    from modules.util.demo_accelerator import lora_passes, passed
    from modules.util.demo_model import make_demo_model

    torch.set_num_threads(1)   # the tiny model's steps are too small to share between threads
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    accelerator = args.accelerator.resolve()
    model_folder = args.work.resolve() / "model" / MODEL.name
    if not model_folder.is_dir():
        make_demo_model(model_folder)
    settings = [(int(steps), float(strength)) for steps, strength in
                (pair.split(":") for pair in args.measure.split(","))]
    for seed in args.seeds:
        for mode in ("base", "preserve"):
            name = f"{mode}-{seed}"
            if mode == "preserve":
                name += f"-strength-{args.strength:g}" + ("" if args.preserve_weight is None else
                                                           f"-weight-{args.preserve_weight:g}")
            lora = train_demo(args.work.resolve() / name, model_folder, accelerator, mode, seed, args.strength,
                              args.preserve_weight)
            for steps, strength in settings:
                passes = lora_passes(model_folder, lora, accelerator, steps, strength)
                trained = ({"trained_strength": args.strength, "preserve_weight": args.preserve_weight}
                           if mode == "preserve" else {})
                print(json.dumps({"seed": seed, "mode": mode, **trained, "steps": steps,
                                  "strength": strength, "passed": passed(passes),
                                  "per_caption": [sum(row) for row in passes.values()]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
