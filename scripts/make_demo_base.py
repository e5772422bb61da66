"""Pre-trains the built-in demo's base and writes it to resources/demo/demo_base.safetensors (float16, with the
training config and the VAE's latent statistics in its metadata). The demo loads that file on first use instead of
training its base there (modules/util/demo_model.py says why and what was measured).

  make_demo_base.py [--output resources/demo/demo_base.safetensors]

Deterministic on one machine for the config in `demo_model.BASE_CONFIG` (one thread); about 3 minutes on a busy
CPU core.
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    from modules.util.demo_model import BASE_FILE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=BASE_FILE)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import torch
    from modules.util.demo_model import train_demo_base
    from modules.util.atomic import save_safetensors_atomic

    torch.set_num_threads(1)   # the tiny model's steps are too small to share between threads
    weights, metadata = train_demo_base()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(weights, args.output, metadata)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
