"""Generates videos with a Wan model (plus LoRA files) and writes them as MP4s; prints each file's path.

  sample.py --base-model-name DIR --prompt "a red square moving left" --output-dir out
  sample.py --base-model-name DIR --lora my_lora.safetensors:0.8 --samples-file samples.txt --output-dir out
Accelerated (a step-distill LoRA on its own 4-step schedule, guidance 1; docs/distilled.md):
  sample.py --base-model-name DIR --accelerator lightx2v_4step.safetensors[:1.0] --prompt "..." --output-dir out
  (a LoRA trained with accelerated previews is sampled with the accelerator its header records, when that file is
  here; --no-accelerator samples it without)
A14B (reads my_lora_high_noise / _low_noise):
  sample.py --base-model-name A14B_DIR --lora my_lora.safetensors ...
Wan2.2-Animate (the video is as long as the pose video, made in segments of --frames):
  sample.py --base-model-name ANIMATE_DIR --prompt "a person dancing" --reference-image me.png \\
      --pose-video clip_pose.mp4 --face-video clip_face.mp4 [--mode replace --background-video clip_bg.mp4 \\
      --mask-video clip_mask.mp4]
Wan2.2-Animate-2 (the character of --reference-image moving as the driving video, as long as it):
  sample.py --base-model-name ANIMATE_2_DIR --prompt "a person dancing" --reference-image me.png \\
      --driving-video dance.mp4 [--reference-prompt "..."] [--continuation-frames 5]
Elements-to-Video (the layout and image encoder the LoRA's header, or the folder's e2v_config.json, records):
  sample.py --base-model-name T2V_DIR --lora e2v_lora.safetensors --element person=me.png \\
      --element background=bg.png --prompt "..." --drop-reference-frames
  (--e2v-config e2v.json for a model that records none: the first dataset's layout is used)

--samples-file takes a samples JSON file or a musubi-tuner style prompt file (one prompt a line with inline options
--w --h --f --s --g --d --fs --n --i --ei). The size, frame, step, guidance and seed options given here are the
defaults that a sample's own settings override. Exit status: 0 done, 1 error, 2 bad arguments.
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401

from modules.util.seed_options import add_sample_options

DTYPE_ALIASES = {"auto": None, "float32": "FLOAT_32", "fp32": "FLOAT_32", "float16": "FLOAT_16", "fp16": "FLOAT_16",
                 "bfloat16": "BFLOAT_16", "bf16": "BFLOAT_16", "float8": "FLOAT_8", "fp8": "FLOAT_8"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model-name", "--base_model_name", "--model_name", dest="base_model_name",
                        help="a diffusers Wan folder, an official Wan release folder or a folder of ComfyUI files (or "
                             "a hub id); default: the base the first LoRA was trained on, as its header records")
    for part in ("transformer", "transformer-2", "vae", "text-encoder", "tokenizer"):
        parser.add_argument(f"--{part}", default="", metavar="PATH",
                            help=f"the {part.replace('-', ' ')} from this file or folder (any layout of "
                                 f"docs/formats.md) instead of the base model's")
    parser.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                        help="a LoRA file in any layout the loader reads (repeatable); for Wan 2.2 A14B a "
                             "_high_noise / _low_noise pair is found from their common name")
    accelerator = parser.add_argument_group("accelerator (docs/distilled.md)")
    accelerator.add_argument("--accelerator", default=None, metavar="PATH[:STRENGTH]",
                             help="a step/CFG-distill LoRA (lightx2v, Wan2.2-Lightning high-noise file, CausVid): "
                                  "every sample runs on its schedule with guidance 1 (--steps sets its step count, "
                                  "default 4); a JSON of what ran is written beside each video")
    accelerator.add_argument("--no-accelerator", action="store_true",
                             help="sample a LoRA without the accelerator its header records (by default a LoRA "
                                  "trained with accelerated previews is sampled with that accelerator, when its "
                                  "file is here), and a step-distilled base on the ordinary schedule (by default "
                                  "on its own: docs/distilled.md)")
    add_accelerator_schedule_arguments(accelerator)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--samples-file", help="a samples JSON file or a musubi-style prompt file")
    parser.add_argument("--negative-prompt", default=None, help="default: Wan's default negative prompt")
    parser.add_argument("--width", type=int, default=None, help="default 832")
    parser.add_argument("--height", type=int, default=None, help="default 480")
    parser.add_argument("--frames", type=int, default=None, help="default 81 (rounded to 4k+1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="default 20; a base read from official / ComfyUI files: the official steps")
    parser.add_argument("--guidance", type=float, default=None,
                        help="default 5.0; a base read from official / ComfyUI files: the official guidance")
    parser.add_argument("--guidance-2", type=float, default=None, help="A14B low-noise expert; default: --guidance")
    parser.add_argument("--flow-shift", type=float, default=None,
                        help="default: the model's scheduler config (the official shift for a base read from files)")
    parser.add_argument("--scheduler", choices=["UNIPC", "EULER"], type=str.upper, default=None)
    parser.add_argument("--seed", type=int, default=None, help="default 42; video k of a sample uses seed + k")
    parser.add_argument("--num-videos", "--num_videos", dest="num_videos", type=int, default=1,
                        help="videos per sample")
    parser.add_argument("--image", default=None, help="first frame (I2V, FLF2V, I2V-A14B, TI2V-5B)")
    parser.add_argument("--last-image", default=None, help="last frame (FLF2V, I2V-A14B)")
    parser.add_argument("--element", action="append", default=[], metavar="NAME=PATH",
                        help="E2V reference image for the element NAME (repeatable) of the layout the LoRA's header "
                             "or the model folder's e2v_config.json records (or --e2v-config gives); NAME is an "
                             "element's name or the word of one of its suffixes (person for _person.png)")
    parser.add_argument("--e2v-config", default=None, metavar="PATH",
                        help="E2V dataset config JSON the model was trained with (nested or flat form; the first "
                             "dataset's elements and processors are used); only for a model that does not record "
                             "its layout, or to check it: a difference from the recorded layout is an error")
    parser.add_argument("--drop-reference-frames", action="store_true", default=None,
                        help="E2V: drop the leading reference frames from the saved videos")
    parser.add_argument("--control-video", default=None, metavar="PATH",
                        help="VACE, Wan-Fun Control: control video or folder of frames (pose, depth, edges, a video "
                             "to edit); a Wan-Fun Control model takes --image as its start image")
    parser.add_argument("--mask-video", default=None, metavar="PATH",
                        help="VACE (and Wan2.2-Fun Control A14B): mask video, white = generate, black = keep the "
                             "control video (VACE: its red channel, grey values kept, as the official code; "
                             "Wan-Fun: binarised at 0.5); "
                             "Animate replace mode: the character's mask (white = character)")
    parser.add_argument("--reference-image", action="append", default=[], metavar="PATH",
                        help="VACE: a reference image (repeatable; the order is kept); Animate: the character to "
                             "animate (one)")
    parser.add_argument("--control-scale", type=float, default=None, help="VACE: strength of the control, default 1")
    parser.add_argument("--image-encoder", default="", metavar="PATH",
                        help="a CLIP vision model (a file such as clip_vision_h.safetensors, or a folder) for an "
                             "I2V transformer file or an E2V LoRA on a base without one; default for an E2V LoRA: "
                             "the one its header records")
    animate = parser.add_argument_group("Wan2.2-Animate and Animate-2 (docs/animate.md)")
    # --reference-image and --mask-video (above) serve Animate too
    for flag, what in (("pose-video", "the driving pose video; the output is as long as it"),
                       ("face-video", "the face crops, frame-aligned with the pose video"),
                       ("background-video", "replace mode: the scene the character goes into")):
        animate.add_argument(f"--{flag}", default=None, metavar="PATH", help=what)
    animate.add_argument("--driving-video", default=None, metavar="PATH",
                         help="Animate-2: the driving video (the motion); the output is as long as it")
    animate.add_argument("--reference-prompt", default=None, metavar="TEXT",
                         help="Animate-2: the prompt of the driving video's reference pass; default the release's "
                              "own (人物动作的参考视频)")
    animate.add_argument("--mode", dest="animate_mode", choices=["animate", "replace"], default=None,
                         help="default animate")
    animate.add_argument("--continuation-frames", type=int, choices=[1, 5], default=None,
                         help="frames of a segment that condition the next (long clips; --frames is the segment "
                              "length); default 1")
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir", default=None,
                        help="default: samples (with --output: that file's folder)")
    add_sample_options(parser)
    parser.add_argument("--dtype", default="auto", type=str.lower,
                        choices=sorted(DTYPE_ALIASES) + ["float_32", "float_16", "bfloat_16", "float_8"],
                        help="weights of the transformer(s) and text encoders (VAE stays float32); "
                             "auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    if args.num_videos < 1:
        parser.error("--num-videos must be at least 1")
    for option in ("width", "height", "frames", "steps"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option} must be at least 1")
    try:
        args.loras = resolve_lora_arguments(args.lora + args.lora_weights)  # (path, strength)
    except ValueError as error:
        parser.error(str(error))
    if args.output_dir is None:
        args.output_dir = str(Path(args.output).parent) if args.output else "samples"
    if not args.base_model_name:
        from modules.util.modelspec import missing_recorded_base, trained_base_model
        args.base_model_name = next((trained_base_model(path) for path, _ in args.loras[:1]), None)
        if not args.base_model_name:
            parser.error("--base-model-name is required (a diffusers Wan folder); no LoRA given records the base it "
                         "was trained on")
        problem = missing_recorded_base(args.base_model_name, f"{args.loras[0][0]}'s header")
        if problem:
            parser.error(problem)
    demo_defaults(args)
    try:
        args.elements = dict(parse_element_argument(text) for text in args.element)
    except ValueError as error:
        parser.error(str(error))
    args.accelerator_config = accelerator_config(args, parser)
    return args


def demo_defaults(args: argparse.Namespace) -> None:
    """The built-in demo's model (modules/util/demo_paths.py) samples at the size its squares were trained at and
    without guidance (its base has no unconditional prediction) unless the command line says otherwise; the
    832 x 480 x 81 default would be minutes of noise there."""
    from modules.util.demo_paths import DEMO_MODEL, DEMO_SAMPLE_DEFAULTS, same_path
    args.demo_note = ""
    args.demo_model = same_path(args.base_model_name, DEMO_MODEL)
    if not args.demo_model:
        return
    filled = {name: value for name, value in DEMO_SAMPLE_DEFAULTS.items() if getattr(args, name) is None}
    for name, value in filled.items():
        setattr(args, name, value)
    if filled:
        args.demo_note = ("the demo's model: " + ", ".join(f"{name} {value:g}" for name, value in filled.items())
                          + " (its squares' settings; give them to override)")


def add_accelerator_schedule_arguments(group) -> None:
    """--accelerator-2 and the accelerator's schedule, as sample.py and compare.py take them."""
    group.add_argument("--accelerator-2", default=None, metavar="PATH",
                       help="A14B: the low-noise expert's accelerator file (default: --accelerator on both)")
    group.add_argument("--accelerator-timesteps", default=None, metavar="T1,T2,...",
                       help="the timestep list out of 1000, highest first (default: 1000,750,500,250 for 4 steps, "
                            "LightX2V's)")
    group.add_argument("--accelerator-shift", type=float, default=None,
                       help="the sigma shift of the accelerator's schedule (default 5, LightX2V's)")


def accelerator_config(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The AcceleratorConfig the --accelerator options name, else the one the first LoRA's header records (unless
    --no-accelerator), else None; a missing file, a file that is not a Wan LoRA or a bad schedule is a usage error
    (exit 2) before any model loads."""
    if args.accelerator and args.no_accelerator:
        parser.error("--accelerator and --no-accelerator contradict each other")
    if not args.accelerator:
        if args.accelerator_2 or args.accelerator_timesteps or args.accelerator_shift is not None:
            parser.error("--accelerator-2 / --accelerator-timesteps / --accelerator-shift need --accelerator")
        if args.no_accelerator:
            return None
        return recorded_accelerator_config(args) or distilled_base_schedule(args)
    from pydantic import ValidationError

    from modules.util.accelerator_metadata import own_schedule
    from modules.util.lora.accelerator_files import accelerator_problems
    from modules.modelSampler.sampling_io import parse_lora_argument
    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    try:
        path, strength = parse_lora_argument(args.accelerator)
        values = dict(file=str(path), file_2=args.accelerator_2 or "", strength=strength)
        # the schedule the file says it was distilled for (its own header), unless the command line sets one
        own = own_schedule(path)
        if own is not None and not args.accelerator_timesteps and args.steps is None:
            values["timesteps"] = own.timestep_list()
        if own is not None and args.accelerator_shift is None:
            values["shift"] = own.shift
        if args.accelerator_timesteps:
            values["timesteps"] = [int(t) for t in args.accelerator_timesteps.split(",")]
        if args.steps is not None:
            values["steps"] = args.steps
        if args.accelerator_shift is not None:
            values["shift"] = args.accelerator_shift
        config = AcceleratorConfig(**values)
    except (ValueError, ValidationError) as error:
        parser.error(f"--accelerator: {error}")
    if config.timesteps and args.steps is not None and args.steps != len(config.timesteps):
        parser.error(f"--steps {args.steps} and --accelerator-timesteps ({len(config.timesteps)} steps) disagree")
    problems = accelerator_problems(config, "--accelerator")
    if problems:
        parser.error("; ".join(problem.replace("--accelerator.file_2", "--accelerator-2")
                               .replace("--accelerator.file", "--accelerator") for problem in problems))
    return config


def recorded_accelerator_config(args: argparse.Namespace):
    """The accelerator the first LoRA's header records its previews ran with (--steps sets its step count), said in
    a printed line; a recorded file missing here is said too, and the LoRA is sampled without it."""
    from modules.modelSampler.sampling_io import lora_files_named
    from modules.util.accelerator_metadata import recorded_accelerator
    for lora, _ in args.loras:
        for path in lora_files_named(lora):
            config = recorded_accelerator(path)
            if config is None or not config.file:   # no file: an accelerator's own schedule, not one it ran with
                continue
            missing = [file for file in (config.file, config.file_2) if file and not Path(file).is_file()]
            if missing:
                print(f"sample: {path} was previewed with the accelerator {' and '.join(missing)}, which is not on "
                      f"this machine: sampling without an accelerator (name one with --accelerator)",
                      file=sys.stderr)
                return None
            if args.steps is not None and args.steps != len(config.timestep_list()):
                config = config.model_copy(update=dict(steps=args.steps, timesteps=[]))
            files = config.file + (f" and {config.file_2}" if config.file_2 else "")
            print(f"sample: {path} was previewed with the accelerator {files} (strength {config.strength:g}, "
                  f"{len(config.timestep_list())} steps): sampling with it (--no-accelerator to sample without)",
                  file=sys.stderr)
            return config
    return None


def distilled_base_schedule(args: argparse.Namespace):
    """A step-distilled base's own schedule (no accelerator file; --steps sets its step count), said in a printed
    line; None for an ordinary base."""
    from modules.util.distilled_base import distilled_base
    found = distilled_base(args.base_model_name)
    if found is None:
        return None
    config = found.schedule()
    if args.steps is not None and args.steps != len(config.timestep_list()):
        config = config.model_copy(update=dict(steps=args.steps, timesteps=[]))
    print(f"sample: {args.base_model_name} is {found.describe()} (--no-accelerator for the ordinary schedule)",
          file=sys.stderr)
    return config


def resolve_lora_arguments(values: list[str]) -> list[tuple]:
    """--lora / --lora_weights values as (path, strength); a folder means the LoRA file in it (seed 004 names the
    folder train --output_dir wrote)."""
    from modules.modelSampler.sampling_io import parse_lora_argument
    from modules.util.seed_options import lora_in_folder
    loras = []
    for text in values:
        path, strength = parse_lora_argument(text)
        loras.append((lora_in_folder(path) if path.is_dir() else path, strength))
    return loras


def parse_element_argument(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--element {text!r}: expected NAME=PATH")
    return name.strip(), path.strip()


def build_samples(args: argparse.Namespace) -> list:
    from modules.util.config.SampleConfig import SampleConfig
    from modules.util.sample_definitions import load_sample_definitions

    if args.samples_file:
        samples = load_sample_definitions(args.samples_file)
    else:
        samples = [SampleConfig(prompt=prompt) for prompt in args.prompt]
    defaults = dict(negative_prompt=args.negative_prompt, width=args.width, height=args.height, frames=args.frames,
                    steps=args.steps, guidance=args.guidance, guidance_2=args.guidance_2, flow_shift=args.flow_shift,
                    scheduler=args.scheduler, seed=args.seed, image=args.image, last_image=args.last_image,
                    elements=args.elements or None, drop_reference_frames=args.drop_reference_frames,
                    control_video=args.control_video, mask_video=args.mask_video,
                    reference_images=args.reference_image or None, control_scale=args.control_scale,
                    # Animate's one reference image is the same flag's (a VACE model reads the list)
                    reference_image=args.reference_image[0] if len(args.reference_image) == 1 else None,
                    pose_video=args.pose_video, face_video=args.face_video,
                    background_video=args.background_video, driving_video=args.driving_video,
                    reference_prompt=args.reference_prompt, animate_mode=args.animate_mode,
                    continuation_frames=args.continuation_frames)
    return [sample.with_defaults(**defaults) for sample in samples]


def ensure_demo_model(folder: str) -> None:
    """The demo's model is made on first use (as the demo's first Start makes it): a few seconds."""
    if not (Path(folder) / "model_index.json").is_file():
        from modules.util.demo_model import make_demo_model
        print(f"sample: creating the tiny demo model at {folder} (a few seconds, once)", file=sys.stderr)
        make_demo_model(folder)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError
    from modules.util.config.config_io import ConfigError
    from modules.util.config.E2VConfig import load_e2v_dataset_configs
    from modules.modelSampler.sampling_io import (apply_lora_files, check_sample_files, generate_videos,
                                                  load_model_for_sampling, resolve_device)
    from modules.util.enum.DataType import DataType
    from modules.util.video_io import UnreadableMediaError

    try:
        e2v_config = load_e2v_dataset_configs(args.e2v_config)[0] if args.e2v_config else None
    except ConfigError as error:
        print(f"sample: --e2v-config: {error}", file=sys.stderr)
        return 2
    try:
        e2v_config, image_encoder, source = e2v_layout(args, e2v_config)
        args.elements = element_names(args, e2v_config, source)
    except ConfigError as error:
        print(f"sample: {error}", file=sys.stderr)
        return 2
    try:
        samples = build_samples(args)
        if not any(sample.enabled for sample in samples):
            print("sample: no enabled samples", file=sys.stderr)
            return 1
        check_sample_files(samples)   # a wrong control or image is named at once, not after minutes of loading
        device = resolve_device(args.device)
        dtype_name = DTYPE_ALIASES.get(args.dtype, args.dtype.upper())
        dtype = DataType(dtype_name) if dtype_name else \
            (DataType.BFLOAT_16 if device.type == "cuda" else DataType.FLOAT_32)
        part_paths = {name: getattr(args, name) for name in ("transformer", "transformer_2", "vae", "text_encoder",
                                                              "tokenizer") if getattr(args, name)}
        # E2V samples are checked against the layout (e2v_layout, element_names), the others here against the variant
        plain = [sample for sample in samples if e2v_config is None and not sample.elements]
        if args.demo_note:
            print(f"sample: {args.demo_note}", file=sys.stderr)
        if args.demo_model:
            ensure_demo_model(args.base_model_name)
        model = load_model_for_sampling(args.base_model_name, dtype, device, image_encoder, part_paths, args.loras,
                                        samples=plain)
        if model.sampling_defaults is not None:
            print(f"sample: {model.variant}: the official settings fill in what is not given: "
                  f"{model.sampling_defaults.describe()}", file=sys.stderr)
        for line in apply_lora_files(model, args.loras):
            print(f"sample: LoRA {line}", file=sys.stderr)
        accelerator = None
        if args.accelerator_config is not None:
            from modules.modelSampler.accelerator import load_accelerator, takes_accelerator
            if not args.accelerator_config.file and not takes_accelerator(model):
                print(f"sample: {model.variant} samples run on their own pipeline: the distilled base's schedule is "
                      f"not used", file=sys.stderr)
            else:
                accelerator = load_accelerator(model, args.accelerator_config)
                print(f"sample: {accelerator.describe()}", file=sys.stderr)
        written = generate_videos(model, samples, args.output_dir, device, num_videos=args.num_videos,
                                  e2v_config=e2v_config, accelerator=accelerator)
        if args.output:
            written = move_to_output(written, args.output)
    except (ModelLoadError, UnreadableMediaError, ValueError, OSError, RuntimeError) as error:
        print(f"sample: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def e2v_layout(args: argparse.Namespace, given):
    """(the E2V dataset config, the image encoder, the file naming the layout) to sample with: --e2v-config and
    --image-encoder, else what the LoRA's header (or the model folder's e2v_config.json) records; a given config that
    differs from the recorded one is a ConfigError naming each difference."""
    from modules.modelSampler.e2v_file_layout import BASE_IMAGE_ENCODER, layout_differences, recorded_layout
    from modules.util.config.config_io import ConfigError
    recorded = recorded_layout(args.base_model_name, [path for path, _ in args.loras])
    if recorded is None:
        return given, args.image_encoder, args.e2v_config
    if given is not None:
        differences = layout_differences(given, recorded)
        if differences:
            raise ConfigError([f"--e2v-config {args.e2v_config} differs from the E2V layout that {recorded.source} "
                               f"records (drop --e2v-config to use the recorded one):"] + differences)
    image_encoder = args.image_encoder
    if not image_encoder and recorded.image_encoder not in ("", BASE_IMAGE_ENCODER):
        image_encoder = recorded.image_encoder
        from modules.util.config.image_encoder_source import looks_like_hub_id
        if not Path(image_encoder).exists() and not looks_like_hub_id(image_encoder):
            raise ConfigError([f"{recorded.source} was trained with the image encoder {image_encoder}, which is not "
                               f"on this machine: name it with --image-encoder"])
    return given or recorded.dataset_config(), image_encoder, recorded.source


def element_names(args: argparse.Namespace, e2v_config, source) -> dict[str, str]:
    """--element by the layout's element names (a suffix's word names its element too), checked before any model
    loads; a ConfigError for a name the layout lacks, or for elements without any layout."""
    from modules.modelSampler.e2v_file_layout import element_arguments
    from modules.util.config.config_io import ConfigError
    if not args.elements:
        return args.elements
    if e2v_config is None:
        raise ConfigError([f"--element needs an E2V model: no LoRA given records an E2V layout and "
                           f"{args.base_model_name} holds no e2v_config.json; name the dataset config it trained with "
                           f"(--e2v-config)"])
    elements, notes = element_arguments(e2v_config, args.elements, source)
    for note in notes:
        print(f"sample: {note}", file=sys.stderr)
    return elements


def move_to_output(written: list, output: str) -> list:
    """--output: the videos renamed to the file named (numbered when several)."""
    import shutil
    from modules.util.seed_options import output_file_names
    targets = output_file_names(output, written)
    for source, target in zip(written, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
    return targets


if __name__ == "__main__":
    sys.exit(main())
