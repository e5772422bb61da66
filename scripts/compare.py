"""Compares LoRA checkpoints at several strengths: the same prompts and seeds for the base model without LoRA and
for every checkpoint x strength, one labelled MP4 grid per prompt plus a contact sheet (PNG) of the middle frame.
The base model is loaded once; each cell merges its LoRA exactly as sample.py does (docs/compare.md).

  compare.py --base-model-name DIR --lora a.safetensors b.safetensors --strengths 0.5 0.75 1.0 \\
      --samples-file samples.json --output-dir compare
  compare.py --lora workspace/run/save --prompt "a red square moving left"   (the base the saves record)
  compare.py --base-model-name DIR --lora workspace/run/backup/<run> --strengths 1.0 ...   (training backups)
  compare.py --lora workspace/run/save --accelerator lightx2v_4step.safetensors[:1.0] --prompt "..."
      (every cell on the accelerator's 4-step schedule, guidance 1; docs/distilled.md)

Exit status: 0 done, 1 error, 2 bad arguments.
"""
import argparse
import sys

import _bootstrap  # noqa: F401

from sample import DTYPE_ALIASES, accelerator_config, add_accelerator_schedule_arguments, build_samples  # noqa: E402  (scripts/sample.py: the same sample options)

from modules.util.config.bounds import MAX_LORA_STRENGTH  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model-name", "--base_model_name", dest="base_model_name", default=None,
                        help="a diffusers Wan folder; default: the base the first checkpoint was trained on, as its "
                             "header (or the backup's config) records")
    parser.add_argument("--lora", nargs="+", required=True, metavar="PATH",
                        help="LoRA files, folders of them (workspace/save) or training backups (a step-N folder or "
                             "a run's backup folder); A14B: a _high_noise / _low_noise pair by its common name")
    parser.add_argument("--strengths", nargs="+", type=float, default=[1.0], metavar="S",
                        help=f"LoRA strengths, each -{MAX_LORA_STRENGTH:g} .. {MAX_LORA_STRENGTH:g} (default 1.0)")
    parser.add_argument("--accelerator", default=None, metavar="PATH[:STRENGTH]",
                        help="a step/CFG-distill LoRA every cell (the base model's too) runs with, on its schedule "
                             "with guidance 1 (--steps sets its step count, default 4)")
    add_accelerator_schedule_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--samples-file", help="a samples JSON file or a musubi-style prompt file")
    parser.add_argument("--negative-prompt", default=None)
    for option, kind in (("width", int), ("height", int), ("frames", int), ("steps", int), ("guidance", float),
                         ("seed", int)):
        parser.add_argument(f"--{option}", type=kind, default=None, help="as in sample.py: a sample's own wins")
    parser.add_argument("--image", default=None, help="first frame (I2V, FLF2V, I2V-A14B, TI2V-5B)")
    parser.add_argument("--last-image", default=None, help="last frame (FLF2V, I2V-A14B)")
    parser.add_argument("--output-dir", default="compare")
    parser.add_argument("--dtype", default="auto", type=str.lower,
                        choices=sorted(DTYPE_ALIASES) + ["float_32", "float_16", "bfloat_16", "float_8"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    bad = [s for s in args.strengths if not -MAX_LORA_STRENGTH <= s <= MAX_LORA_STRENGTH]
    if bad:
        parser.error(f"--strengths: {bad} outside -{MAX_LORA_STRENGTH:g} .. {MAX_LORA_STRENGTH:g}")
    if len(set(args.strengths)) != len(args.strengths):
        parser.error(f"--strengths: {args.strengths} repeats a value")
    for option in ("width", "height", "frames", "steps"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    # the sample options compare.py does not offer, for sample.py's build_samples
    args.guidance_2 = args.flow_shift = args.scheduler = args.drop_reference_frames = None
    args.elements = {}
    args.control_video = args.mask_video = args.control_scale = None                       # VACE
    args.pose_video = args.face_video = args.background_video = args.animate_mode = None    # Animate
    args.continuation_frames, args.reference_image = None, []
    args.driving_video = args.reference_prompt = None                                      # Animate-2
    args.no_accelerator = False
    any_accelerator = args.accelerator or args.accelerator_2 or args.accelerator_timesteps or \
        args.accelerator_shift is not None
    args.accelerator_config = accelerator_config(args, parser) if any_accelerator else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError
    from modules.modelSampler.compare_run import compare_checkpoints
    from modules.modelSampler.lora_checkpoints import find_checkpoints, trained_base
    from modules.modelSampler.sampling_io import load_model_for_sampling, resolve_device
    from modules.util.enum.DataType import DataType
    from modules.util.modelspec import missing_recorded_base
    from modules.util.video_io import UnreadableMediaError

    try:
        samples = build_samples(args)
        if not any(sample.enabled for sample in samples):
            print("compare: no enabled samples", file=sys.stderr)
            return 1
        checkpoints = find_checkpoints(args.lora)  # a missing file or an empty folder stops before the model loads
        if not args.base_model_name:
            args.base_model_name = trained_base(checkpoints[0])
            if not args.base_model_name:
                print("compare: --base-model-name is required: the first checkpoint records no base model",
                      file=sys.stderr)
                return 2
            problem = missing_recorded_base(args.base_model_name, checkpoints[0].source)
            if problem:
                print(f"compare: {problem}", file=sys.stderr)
                return 2
            print(f"compare: base model {args.base_model_name} (recorded by {checkpoints[0].source})",
                  file=sys.stderr)
    except (ValueError, OSError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device)
        dtype_name = DTYPE_ALIASES.get(args.dtype, args.dtype.upper())
        dtype = DataType(dtype_name) if dtype_name else \
            (DataType.BFLOAT_16 if device.type == "cuda" else DataType.FLOAT_32)
        model = load_model_for_sampling(args.base_model_name, dtype, device)
        accelerator = None
        if args.accelerator_config is not None:
            from modules.modelSampler.accelerator import load_accelerator
            accelerator = load_accelerator(model, args.accelerator_config)
            print(f"compare: {accelerator.describe()}", file=sys.stderr)
        outputs = compare_checkpoints(
            model, args.lora, args.strengths, samples, args.output_dir, device,
            on_cell=lambda index, cell, _: print(f"compare: sample {index}: {cell.title}"
                                                 f"{'' if cell.checkpoint is None else f' at {cell.strength:g}'}",
                                                 file=sys.stderr),
            accelerator=accelerator)
    except (ModelLoadError, UnreadableMediaError, ValueError, OSError, RuntimeError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 1
    for output in outputs:
        print(output.video)
        print(output.sheet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
