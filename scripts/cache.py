"""Fills the latent, text and image caches for a training config and stops (the same as train.py --only-cache).

  cache.py --config-path my.json [--preset-path P.json] [--config-value dotted.key=value ...]
"""
import sys

import _bootstrap  # noqa: F401

from train import main as train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:] + ["--only-cache"]))
