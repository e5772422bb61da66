"""Distils the demo's base (resources/demo/demo_base.safetensors) into a 4-step accelerator LoRA and writes it to
resources/demo/demo_accelerator.safetensors, in the layout of lightx2v's Wan LoRAs, its schedule (timesteps
[1000, 750, 500, 250], shift 5) in its header; then measures it: the base's 6 captions at seeds 0 to 3 with the
accelerator, and the base alone at 4 and 40 steps (`caption_square_problems`).

Method: rectified-flow reflow on the accelerator's sigmas (Liu, Gong, Liu, "Flow Straight and Fast", ICLR 2023,
arXiv:2209.03003; modules/util/demo_accelerator.py says how).

  make_demo_accelerator.py [--output resources/demo/demo_accelerator.safetensors]
  make_demo_accelerator.py --output /tmp/try.safetensors --steps 2 --noise-seeds 1 --no-measure   (a quick try)

Run it again after the demo base changes (scripts/make_demo_base.py): it distils whatever base is shipped.
Deterministic on one machine (one thread); a few minutes on a busy CPU core.
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    from modules.util.demo_accelerator import ACCELERATOR_FILE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ACCELERATOR_FILE)
    parser.add_argument("--steps", type=int, default=None, help="distillation steps (default: DISTILL_CONFIG's)")
    parser.add_argument("--noise-seeds", type=int, default=None,
                        help="noise seeds per caption the teacher samples (default: DISTILL_CONFIG's)")
    parser.add_argument("--no-measure", action="store_true", help="write the file without measuring it")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import torch
    from modules.util.demo_accelerator import DISTILL_CONFIG, make_demo_accelerator

    config = dict(DISTILL_CONFIG)
    if args.steps is not None:
        config["steps"] = args.steps
    if args.noise_seeds is not None:
        config["noise_seeds_per_caption"] = args.noise_seeds
    torch.set_num_threads(1)   # the tiny model's steps are too small to share between threads
    make_demo_accelerator(args.output, config, measure=not args.no_measure)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
