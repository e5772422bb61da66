"""Writes a tiny random Wan model as a diffusers folder (for tests and the demo; no download needed).

  make_tiny_model.py --variant wan2.1-t2v --output workspace/tiny-t2v [--seed 0]
  make_tiny_model.py --variant wan2.1-vace --squares-vae --output workspace/tiny-vace (for the VACE demo set)
  make_tiny_model.py --variant wan2.2-animate --squares-vae --output workspace/tiny-animate (for the Animate demo set)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402

from modules.util.tiny_animate import ANIMATE_VARIANTS  # noqa: E402
from modules.util.tiny_models import VARIANTS  # noqa: E402
from modules.util.tiny_pipelines import make_tiny_model  # noqa: E402

SQUARES_VAE_VARIANTS = ("wan2.1-vace", "wan2.2-animate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", required=True, choices=VARIANTS + ANIMATE_VARIANTS)
    parser.add_argument("--output", required=True, type=Path,
                        help="folder to write; an existing one is replaced only if empty or a diffusers folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--squares-vae", action="store_true",
                        help="wan2.1-vace and wan2.2-animate: the demo's VAE, which encodes each 8x8 cell as its "
                             "colour, so that a model trained on make_demo_dataset --kind vace (or --kind animate) can "
                             "see where the square and its control (the character and its pose) are (a random tiny "
                             "VAE hardly encodes positions)")
    args = parser.parse_args(argv)
    if args.squares_vae and args.variant not in SQUARES_VAE_VARIANTS:
        parser.error(f"--squares-vae is for --variant {' or '.join(SQUARES_VAE_VARIANTS)}, not {args.variant}")
    try:
        if args.squares_vae and args.variant == "wan2.2-animate":
            from modules.util.demo_animate import make_demo_animate_model
            folder = make_demo_animate_model(args.output, seed=args.seed)
        elif args.squares_vae:
            from modules.util.demo_vace import make_demo_vace_model
            folder = make_demo_vace_model(args.output, seed=args.seed)
        else:
            folder = make_tiny_model(args.variant, args.output, seed=args.seed)
    except FileExistsError as error:
        print(f"make_tiny_model.py: {error}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
