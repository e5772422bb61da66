"""Writes a synthetic demo dataset: coloured squares moving left or right (t2v), the E2V set (e2v), the VACE set
(vace: each clip with its control, the square's outline, and a reference image of the square), or the Wan2.2-Animate
set (animate: a character following a drawn skeleton, with pose, face, reference, background and mask companions), or
the Wan2.2-Animate-2 set (animate-2: the character and a driving video of another performer doing the same motion).

  make_demo_dataset.py --kind t2v --output DIR
"""
import argparse
import sys

import _bootstrap  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["t2v", "e2v", "vace", "animate", "animate-2"], default="t2v")
    parser.add_argument("--output", required=True)
    parser.add_argument("--clips-per-class", type=int, default=4)
    parser.add_argument("--frames", type=int, default=None,
                        help="frames per clip; default 9 (t2v, vace), 17 (e2v: the aligned references 1 + 4 + 4 and "
                             "the clip's own frames fill a 17-frame bucket; animate: the smallest frame bucket of the "
                             "Animate presets)")
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.kind == "t2v":
        from modules.util.demo_assets import make_t2v_dataset
        folder = make_t2v_dataset(args.output, args.clips_per_class, args.frames or 17, args.size)
    elif args.kind == "vace":
        from modules.util.demo_vace import make_vace_dataset
        folder = make_vace_dataset(args.output, args.clips_per_class, args.frames or 17, args.size)
    elif args.kind == "animate":
        from modules.util.demo_animate import make_animate_dataset
        folder = make_animate_dataset(args.output, args.clips_per_class, args.frames or 17, args.size)
    elif args.kind == "animate-2":
        from modules.util.demo_animate import make_animate_2_dataset
        # 9 frames: the Animate-2 preset's frame bucket (its 24 GB promise holds at 9 frames of 480p)
        folder = make_animate_2_dataset(args.output, args.clips_per_class, args.frames or 9, args.size)
    else:
        from modules.util.demo_e2v import make_e2v_dataset
        folder = make_e2v_dataset(args.output, args.clips_per_class, args.frames or 17, args.size)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
