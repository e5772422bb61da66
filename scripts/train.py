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
    parser.add_argument("--dataset-config", "--dataset_config", dest="dataset_config", metavar="TOML",
                        help="a musubi-tuner or diffusion-pipe dataset config (TOML): its datasets become the concepts "
                             "(data.dataset_config; docs/data.md)")
    parser.add_argument("--only-cache", action="store_true", help="fill the caches and stop")
    e2v = parser.add_argument_group("Elements-to-Video, as in the user's notes (seed 001); --config-value wins")
    e2v.add_argument("--dataset_configs", "--dataset-configs", help="an E2V dataset config JSON")
    e2v.add_argument("--e2v_type", "--e2v-type", choices=["vae", "clip", "dual"])
    e2v.add_argument("--frame_conditioning_type", "--frame-conditioning-type",
                     choices=["full", "index", "prefix", "random", "first_and_last"])
    e2v.add_argument("--frame_conditioning_index", "--frame-conditioning-index", type=int)
    e2v.add_argument("--frame_conditioning_concatenate_mask", "--frame-conditioning-concatenate-mask",
                     action="store_true", default=None)
    e2v.add_argument("--training_type", "--training-type", choices=sorted(TRAINING_TYPES))
    e2v.add_argument("--rank", type=int)
    e2v.add_argument("--lora_alpha", "--lora-alpha", type=float)
    e2v.add_argument("--output_dir", "--output-dir", help="the adapter (or model) is written here")
    e2v.add_argument("--model_name", "--model-name", help="a diffusers folder or hub id")
    e2v.add_argument("--mixed_precision", "--mixed-precision", choices=sorted(MIXED_PRECISION))
    return parser.parse_args(argv)


TRAINING_TYPES = {"e2v-lora": "LORA", "e2v-sft": "FINE_TUNE", "lora": "LORA", "sft": "FINE_TUNE"}
MIXED_PRECISION = {"bf16": "BFLOAT_16", "fp16": "FLOAT_16", "no": "FLOAT_32"}


def seed_options_as_overrides(args: argparse.Namespace) -> list[str]:
    """The finetrainers-style options of the user's notes, as dotted overrides (applied before --config-value)."""
    from pathlib import Path
    values = []
    if args.dataset_config:
        values.append(f"data.dataset_config={args.dataset_config}")
    if args.dataset_configs:
        values.append(f"e2v.dataset_config={args.dataset_configs}")
    if args.e2v_type:
        values.append(f"e2v.e2v_type={args.e2v_type}")
    if args.frame_conditioning_type:
        values.append(f"e2v.frame_conditioning={args.frame_conditioning_type}")
    if args.frame_conditioning_index is not None:
        values.append(f"e2v.frame_index={args.frame_conditioning_index}")
    if args.frame_conditioning_concatenate_mask:
        values.append("e2v.concatenate_mask=true")
    method = TRAINING_TYPES.get(args.training_type or "")
    if method:
        values.append(f"training_method={method}")
    if args.rank is not None:
        values.append(f"lora.rank={args.rank}")
    if args.lora_alpha is not None:
        values.append(f"lora.alpha={args.lora_alpha}")
    if args.output_dir:
        out = Path(args.output_dir)
        name = "e2v_lora.safetensors" if method != "FINE_TUNE" else "model"
        values += [f"workspace_dir={out / 'workspace'}", f"output.destination={out / name}"]
        if method == "FINE_TUNE":
            values.append("output.format=DIFFUSERS")
    if args.model_name:
        values.append(f"model.base_model_name={args.model_name}")
        if not Path(args.model_name).is_dir():
            values.append("model.allow_download=true")  # naming a hub id is asking for the download
    if args.mixed_precision:
        values.append(f"train_dtype={MIXED_PRECISION[args.mixed_precision]}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config_path, args.preset_path,
                             seed_options_as_overrides(args) + args.config_value)
        from modules.trainer.GenericTrainer import GenericTrainer, prepare_config
        e2v_datasets = prepare_config(config)
    except ConfigError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    from modules.trainer.GenericTrainer import TrainingError
    try:
        trainer = GenericTrainer(config, e2v_datasets=e2v_datasets)
        if args.only_cache:
            trainer.cache_only()
        else:
            trainer.train()
    except ConfigError as e:  # found once the model is known (a preview it cannot sample), before any step
        print(f"train: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"train: {e}", file=sys.stderr)
        return 1
    if trainer.stop_requested.is_set():
        print(f"stopped; to resume, run:\n  {resume_command(argv, config.workspace_dir)}", flush=True)
    return 0


def resume_command(argv: list[str] | None, workspace_dir: str) -> str:
    """The command line that continues this run from its last backup, runnable from any folder."""
    import os
    import shlex
    from pathlib import Path
    args = list(sys.argv[1:] if argv is None else argv)
    args += ["--config-value", "backup.continue_last_backup=true", "--config-value",
             f"workspace_dir={Path(workspace_dir).resolve()}"]
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(command)}"


if __name__ == "__main__":
    sys.exit(main())
