"""Trains a Wan model. Exit codes: 0 success, 2 configuration error (before any model loads), 1 failure.

  train.py --preset-path "training_presets/#demo tiny CPU.json"
  train.py --config-path my.json --config-value lora.rank=16 --config-value optimizer.learning_rate=2e-4
"""
import argparse
import sys

import _bootstrap  # noqa: F401

from modules.util.config.config_io import ConfigError, load_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-path", help="a training config JSON")
    parser.add_argument("--preset-path", help="a preset from training_presets/ (sparse JSON over the defaults)")
    parser.add_argument("--config-value", action="append", default=[], metavar="DOTTED.KEY=VALUE",
                        help="override one value (JSON values parse: numbers, true/false, lists); repeatable")
    parser.add_argument("--only-cache", action="store_true", help="fill the caches and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config_path, args.preset_path, args.config_value)
        from modules.trainer.GenericTrainer import GenericTrainer, prepare_config
        prepare_config(config)
    except ConfigError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    from modules.trainer.GenericTrainer import TrainingError
    try:
        trainer = GenericTrainer(config)
        if args.only_cache:
            trainer.cache_only()
        else:
            trainer.train()
    except TrainingError as e:
        print(f"train: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
