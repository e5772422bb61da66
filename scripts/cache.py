"""Fills the latent, text and image caches for a training config and stops (what train.py --only-cache does);
a later train.py run with the same settings finds them. Exit codes: 0 done, 2 configuration error, 1 failure.

  cache.py --config-path my.json [--preset-path NAME_OR_FILE] [--config-value dotted.key=value ...]
"""
import sys

import _bootstrap  # noqa: F401

from train import build_parser
from train import main as train_main

if __name__ == "__main__":
    sys.exit(train_main(parser=build_parser(__doc__, only_cache_option=False)))
