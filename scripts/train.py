"""Trains a Wan model. Exit codes: 0 success, 2 configuration error (before any model loads), 1 failure.

  train.py --preset-path "demo tiny CPU"
  train.py --preset-path "wan 2.1 1.3B LoRA 24GB" --config-path my.json --config-value lora.rank=16
  train.py --list-presets
  torchrun --nproc-per-node 2 scripts/train.py --config-path my.json (several GPUs: docs/multi-gpu.md)
"""
import argparse
import sys
import traceback

import _bootstrap  # noqa: F401

from modules.util.config.config_io import ConfigError, load_config
from modules.util.seed_options import add_train_options, train_overrides


def build_parser(description: str = __doc__, only_cache_option: bool = True) -> argparse.ArgumentParser:
    """The options of train.py; scripts/cache.py shares them with its own description."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-path", help="a training config JSON")
    parser.add_argument("--preset-path", help="a preset: a file, or the name of a shipped one (see --list-presets)")
    parser.add_argument("--list-presets", action="store_true", help="list the shipped presets and stop")
    parser.add_argument("--config-value", action="append", default=[], metavar="DOTTED.KEY=VALUE",
                        help="override one value (JSON values parse: numbers, true/false, lists); repeatable")
    parser.add_argument("--dataset-config", "--dataset_config", dest="dataset_config", metavar="TOML",
                        help="a musubi-tuner or diffusion-pipe dataset config (TOML): its datasets become the concepts "
                             "(data.dataset_config; docs/data.md)")
    parser.add_argument("--plan", action="store_true",
                        help="print the predicted peak device memory (and with --vram-gib the settings that fit) "
                             "and stop; nothing loads (docs/benchmarks.md)")
    from modules.planner.plan_command import add_plan_arguments
    add_plan_arguments(parser)
    if only_cache_option:
        parser.add_argument("--only-cache", action="store_true", help="fill the caches and stop")
    else:
        parser.set_defaults(only_cache=True)  # cache.py: caching is all it does
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
    e2v.add_argument("--output_dir", "--output-dir",
                     help="the result is written here, named by what it is (lora.safetensors, e2v_lora.safetensors, "
                          "model/, e2v_model/, embedding.safetensors), and the workspace goes in its workspace/")
    e2v.add_argument("--model_name", "--model-name", help="a diffusers folder or hub id")
    e2v.add_argument("--mixed_precision", "--mixed-precision", choices=sorted(MIXED_PRECISION))
    e2v.add_argument("--image_encoder", "--image-encoder", metavar="PATH_OR_HUB_ID",
                     help="the CLIP vision model of E2V's clip / dual pathway for a base without one "
                          "(model.image_encoder.path): a diffusers folder with image_encoder/ (a Wan 2.1 I2V folder), "
                          "a CLIP vision folder, or a hub id; default for a hub-id base: Wan 2.1 I2V's")
    add_train_options(parser)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


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
        values.append(f"workspace_dir={Path(args.output_dir) / 'workspace'}")  # the output's name: output_dir_name
    if args.model_name:
        values.append(f"model.base_model_name={args.model_name}")
        if not Path(args.model_name).is_dir():
            values.append("model.allow_download=true")  # naming a hub id is asking for the download
    if args.mixed_precision:
        values.append(f"train_dtype={MIXED_PRECISION[args.mixed_precision]}")
    if args.image_encoder:
        values.append(f"model.image_encoder.path={args.image_encoder}")
        if not Path(args.image_encoder).exists():
            values.append("model.allow_download=true")  # a hub id: naming it is asking for the download
    return values + train_overrides(args)


def output_dir_name(config) -> str:
    """What --output_dir names the result: by what it is (a plain LoRA is not an E2V LoRA)."""
    prefix = "e2v_" if config.e2v.enabled else ""
    return {"LORA": f"{prefix}lora.safetensors", "FINE_TUNE": f"{prefix}model",
            "EMBEDDING": "embedding.safetensors"}[config.training_method.value]


def apply_output_dir(config, output_dir: str, overrides: list[str]) -> None:
    """--output_dir sets the output's path (and a fine-tune's format, a diffusers folder) unless a --config-value
    sets them."""
    from pathlib import Path
    keys = {text.split("=", 1)[0].strip() for text in overrides}
    if "output.destination" not in keys:
        config.output.destination = str(Path(output_dir) / output_dir_name(config))
    if config.training_method.value == "FINE_TUNE" and "output.format" not in keys:
        config.output.format = "DIFFUSERS"


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = (parser or build_parser()).parse_args(argv)
    from modules.util.launcher_watch import die_with_launcher_if_rank
    die_with_launcher_if_rank()   # first: a launcher killed while this rank loads its config takes it too
    if args.list_presets:
        from modules.util.presets import presets_table
        print(presets_table())
        return 0
    try:
        from modules.util.presets import resolve_preset
        preset = resolve_preset(args.preset_path) if args.preset_path else None
        config = load_config(args.config_path, preset, seed_options_as_overrides(args) + args.config_value)
        if args.output_dir:
            apply_output_dir(config, args.output_dir, args.config_value)
        if config.remote.host:
            print(f"train: remote.host {config.remote.host!r} is set, but `train` runs here; `remote train` runs the "
                  f"same config there (docs/remote.md)", file=sys.stderr)
        from modules.trainer.distributed import config_problems, launched_by_torchrun, process_count, relaunch
        from modules.trainer.GenericTrainer import GenericTrainer
        from modules.trainer.prepare import prepare_config
        problems = config_problems(config)
        try:
            e2v_datasets = prepare_config(config)
        except ConfigError as e:
            raise ConfigError(e.problems + problems, e.source) from None
        if problems:
            raise ConfigError(problems)
    except ConfigError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    from modules.planner.plan_command import check_fits_device, plan_and_print
    if args.plan:
        return plan_and_print(config, args.vram_gib, args.plan_json, caching=not args.skip_caching, gpus=args.gpus,
                              ram_gib=args.ram_gib)
    if not args.only_cache:
        from modules.planner.memory_plan import PlanError
        from modules.util.devices import resolve_device
        try:  # before any weight loads
            check_fits_device(config, resolve_device(config.device), args.vram_gib, ram_gib=args.ram_gib)
        except PlanError as e:  # predicted not to fit, or performance.auto_fit found nothing that fits
            print(f"train: {e}", file=sys.stderr)
            return 2
    if config.multi_gpu and not launched_by_torchrun() and process_count(config) > 1:
        from modules.trainer.workspace_lock import check_workspace_free
        try:  # refused here at once, rather than by rank 0 once every rank has started
            check_workspace_free(config.workspace_dir)
        except ConfigError as e:
            print(f"train: {e}", file=sys.stderr)
            return 2
        # every process runs the same script (train.py or cache.py) with the same arguments; under torchrun's
        # environment they join one job
        return relaunch(config, getattr(sys.modules["__main__"], "__file__", None) or __file__, argv)
    from modules.trainer.distributed import leave_process_group
    from modules.util.ranks import rank_and_world
    from modules.trainer.GenericTrainer import TrainingError
    trainer = None
    try:
        trainer = GenericTrainer(config, e2v_datasets=e2v_datasets)
        if args.only_cache:
            trainer.cache_only()
        else:
            trainer.train()
    except ConfigError as e:  # found once the model is known (a preview it cannot sample, a hub id's variant)
        print(f"train: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: every file is written atomically, so none is left half-written
        print("\ntrain: aborted by a second Ctrl-C; files already written are complete, the one being written was "
              "dropped", file=sys.stderr)
        if trainer is not None and trainer.parallel.is_main:
            print(stop_advice(trainer, argv, "to resume from the last backup"), flush=True)
        return 130
    except Exception as e:
        if not launched_by_torchrun():
            raise
        # one line naming the rank after the traceback: a collective that broke off means another rank failed (its
        # own output names the cause) or timed out
        traceback.print_exc()
        rank, world = rank_and_world()
        print(f"train: rank {rank} of {world} stopped: {(str(e).splitlines() or [type(e).__name__])[0]}",
              file=sys.stderr)
        if trainer is not None and trainer.run_name:
            # this rank may be the one left: the way on is the same command resumed on every machine
            print(stop_advice(trainer, argv, "the job stopped; to resume from the last backup, start it on every "
                              "machine as before (torchrun ... scripts/train.py) with these arguments"),
                  file=sys.stderr, flush=True)
        return 1
    finally:
        leave_process_group()
    if trainer.stop_requested.is_set():  # exit 130 as for any Ctrl-C: `train && next` must not go on
        if trainer.parallel.is_main:
            if trainer.completed:
                print("stopped after the final save was written: the run is complete", flush=True)
            else:
                print(stop_advice(trainer, argv, "stopped; to resume"), flush=True)
        return 130
    return 0


def stop_advice(trainer, argv: list[str] | None, resume_text: str) -> str:
    """What to run after a Ctrl-C: the command that resumes this run when it has a backup; else (stopped while
    caching, or a second Ctrl-C before its first backup) the same command again, since a resume would continue
    whichever other run of the workspace was written last."""
    from modules.trainer.backup_io import verify_backup, workspace_backups
    run = trainer.run_name
    if run and any(not verify_backup(b) for b in workspace_backups(trainer.backup_base).get(run, [])):
        return f"{resume_text}, run:\n  {resume_command(argv, trainer.config.workspace_dir, run)}"
    return (f"stopped before this run wrote a backup (the cache is kept); to start it again, run:\n  "
            f"{resume_command(argv, trainer.config.workspace_dir)}")


def resume_command(argv: list[str] | None, workspace_dir: str, run_name: str = "") -> str:
    """The command line that continues run `run_name` from its last backup (without a name: the same command
    again), runnable from any folder. The run is named: another run may write to the workspace meanwhile."""
    import os
    import shlex
    from pathlib import Path
    args = list(sys.argv[1:] if argv is None else argv)
    if run_name:
        args += ["--config-value", "backup.continue_last_backup=true", "--config-value", f"run_name={run_name}"]
    args += ["--config-value", f"workspace_dir={Path(workspace_dir).resolve()}"]
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(command)}"


if __name__ == "__main__":
    sys.exit(main())
