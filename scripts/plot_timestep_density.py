"""Plots the density of the training timestep (sigma) distributions, drawn with the trainer's own sampler
(modules/modelSetup/timestep_sampling.py, through modules/ui/plot_data.py), as a PNG line chart (docs/configuration.md shows it).

  plot_timestep_density.py [--output docs/images/timestep_density.png] [--shift 3.0] [--count 200000]
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401

CURVES = [  # (label, timestep settings, RGB)
    ("sigmoid_shift (musubi-tuner's shift)", {"distribution": "sigmoid_shift"}, (200, 40, 40)),
    ("uniform_shift", {"distribution": "uniform_shift"}, (40, 90, 200)),
    ("logit_normal (0, 1)", {"distribution": "logit_normal"}, (40, 150, 60)),
    ("uniform", {"distribution": "uniform"}, (120, 120, 120)),
]
WIDTH, HEIGHT, MARGIN = 900, 520, 60
BINS = 50


def draw(curves: list[tuple[str, list[float], tuple[int, int, int]]], title: str):
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    pen = ImageDraw.Draw(image)
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN
    top = max(max(values) for _, values, _ in curves) * 1.1

    def point(x: float, y: float) -> tuple[float, float]:
        return MARGIN + x * plot_w, HEIGHT - MARGIN - y / top * plot_h

    pen.rectangle([MARGIN, MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN], outline="black")
    for tick in range(11):
        x, y = point(tick / 10, 0)
        pen.line([x, y, x, y + 5], fill="black")
        pen.text((x - 8, y + 8), f"{tick / 10:.1f}", fill="black")
    step = 0.5 if top < 4 else 1.0
    level = 0.0
    while level <= top:
        x, y = point(0, level)
        pen.line([x - 5, y, x, y], fill="black")
        pen.text((x - 30, y - 6), f"{level:.1f}", fill="black")
        level += step
    pen.text((WIDTH / 2 - 60, HEIGHT - MARGIN + 28), "sigma (noise level)", fill="black")
    pen.text((8, MARGIN - 30), "density", fill="black")
    pen.text((MARGIN, 12), title, fill="black")
    for row, (label, values, colour) in enumerate(curves):
        points = [point((i + 0.5) / len(values), v) for i, v in enumerate(values)]
        pen.line(points, fill=colour, width=3)
        pen.line([WIDTH - MARGIN - 280, MARGIN + 18 + 18 * row, WIDTH - MARGIN - 250, MARGIN + 18 + 18 * row],
                 fill=colour, width=3)
        pen.text((WIDTH - MARGIN - 244, MARGIN + 12 + 18 * row), label, fill="black")
    return image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent.parent / "docs" / "images" /
                                                "timestep_density.png"))
    parser.add_argument("--shift", type=float, default=3.0, help="the flow shift of the shifted distributions")
    parser.add_argument("--count", type=int, default=200_000, help="draws per distribution")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from modules.ui.plot_data import timestep_density
    from modules.util.atomic import atomic_path
    from modules.util.config.OptimizerConfig import TimestepConfig
    curves = [(label, timestep_density(TimestepConfig(shift=args.shift, **settings), BINS, args.count), colour)
              for label, settings, colour in CURVES]
    image = draw(curves, f"training sigma density, shift {args.shift:g} ({args.count} draws each, {BINS} bins)")
    with atomic_path(args.output) as tmp:
        image.save(tmp, format="PNG")
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
