"""Sampling outside training: LoRA files applied for inference, model loading for sampling, and videos written to
files (scripts/sample.py, scripts/convert_model.py --merge-lora)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from modules.model.WanModel import WanModel
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler, check_sample_inputs, round_frames
from modules.modelSampler.vace_sampling import control_file_problems
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.expert_metadata import expert_notes, expert_problem, recorded_expert

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- LoRA files (inference)

def parse_lora_argument(text: str) -> tuple[Path, float]:
    """`PATH[:STRENGTH]` -> (path, strength). The suffix counts as a strength only when it parses as a number, so
    Windows drive letters and colons in file names survive."""
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(text), 1.0


def _expert_files(model: WanModel, path: Path) -> dict[str, Path]:
    """Which expert each LoRA file goes to. Single-expert models: the transformer. A14B: a `_high_noise` file to the
    high-noise expert, `_low_noise` to the low-noise one, a name whose `_high_noise` / `_low_noise` pair exists to
    both, any other existing file to both experts."""
    from modules.util.lora.formats import expert_lora_paths

    if not model.variant.has_two_experts:
        if not path.is_file():
            raise FileNotFoundError(f"LoRA file {str(path)!r} does not exist")
        return {"transformer": path}
    stem = path.name.removesuffix(".safetensors")
    if path.is_file():
        if stem.endswith("_high_noise"):
            return {"transformer": path}
        if stem.endswith("_low_noise"):
            return {"transformer_2": path}
        recorded, _ = recorded_expert(path)
        if recorded in ("high", "low"):  # its header says which expert it is for
            return {"transformer" if recorded == "high" else "transformer_2": path}
        if recorded != "both":
            logger.warning("LoRA %s has no _high_noise / _low_noise suffix: applied to both experts", path)
        return {"transformer": path, "transformer_2": path}
    high, low = expert_lora_paths(path)
    pair = {name: p for name, p in (("transformer", high), ("transformer_2", low)) if p.is_file()}
    if not pair:
        raise FileNotFoundError(f"LoRA file {str(path)!r} does not exist, nor its expert pair {high.name} / "
                                f"{low.name}")
    return pair


def apply_lora_files(model: WanModel, loras: list[tuple[Path, float]]) -> list[str]:
    """Merges LoRA files (any layout `load_lora_file` reads) into the transformer weights at their strengths, for
    inference. Returns one line per file applied."""
    from modules.util.lora.apply import merge_lora
    from modules.util.lora.formats import LoraMatchError, load_lora_file, match_to_model
    from modules.util.modelspec import lora_family_refusal, lora_model_mismatch, lora_shape_message

    from modules.model.e2v_lora import apply_e2v_parts, read_e2v_lora
    from modules.util.lora.formats import lora_from_state_dict

    applied = []
    for path, strength in loras:
        files = _expert_files(model, Path(path))
        for expert, file in files.items():
            if model.variant.has_two_experts:
                problem = expert_problem(file, expert, "the LoRA")
                if problem:
                    raise SampleError(problem)
                notes = expert_notes(file, expert, model.boundary_ratio)
                if len(files) == 2:  # a 'both' file applied to both experts is what it was made for
                    notes = [note for note in notes if "'both'" not in note]
                for note in notes:
                    logger.warning("notice: %s", note)
            transformer = getattr(model, expert)
            lora_tensors, e2v_parts, e2v_config = read_e2v_lora(file)
            if e2v_parts:
                # an E2V LoRA: expand the base as training did and load the trained expanded parts first
                try:
                    apply_e2v_parts(model, e2v_parts, e2v_config)
                except (KeyError, RuntimeError, ValueError) as error:
                    raise SampleError(lora_shape_message(file, model.variant, error)) from None
                transformer = getattr(model, expert)
                weights, layout = lora_from_state_dict(lora_tensors)
            else:
                weights, layout = load_lora_file(file)
            if refusal := lora_family_refusal(file, model.variant):
                raise SampleError(refusal)
            mismatch = lora_model_mismatch(file, model.variant)
            if mismatch:
                logger.warning("%s; it is applied anyway, but expect poor or broken output", mismatch)
            try:
                weights = match_to_model(weights, [name for name, _ in transformer.named_modules()])
                merge_lora(transformer, weights, strength)
            except (LoraMatchError, ValueError) as error:
                raise SampleError(lora_shape_message(file, model.variant, error)) from None
            applied.append(f"{file} ({layout}, {len(weights)} modules, strength {strength:g}) -> {expert}")
    return applied


# ---------------------------------------------------------------------------------------------- inference to files

def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else as torch names it (cpu, cuda, cuda:1)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SampleError(f"device {name!r}: CUDA is not available on this machine")
    return device


def lora_files_named(path: Path) -> list[Path]:
    """The files a LoRA path stands for: itself, or an A14B pair's `_high_noise` / `_low_noise` files."""
    from modules.util.lora.formats import expert_lora_paths
    return [file for file in (path, *expert_lora_paths(path)) if file.is_file()]


def load_model_for_sampling(base_model_name: str, weight_dtype, device: torch.device,
                            image_encoder_path: str = "", part_paths: dict[str, str] | None = None,
                            loras: list[tuple[Path, float]] = (), samples: list[SampleConfig] = ()) -> WanModel:
    """Loads a Wan model for inference (any layout of docs/formats.md; `part_paths` maps transformer,
    transformer_2, vae, text_encoder, tokenizer to a file or folder): transformer(s), text and image encoders in
    `weight_dtype` (a DataType), the VAE in float32. A single transformer goes to `device` at once; the two A14B experts, the text
    encoder, CLIP and the VAE stay on the CPU and the sampler moves each to `device` while it is used. `loras`, the
    files apply_lora_files will apply: one made for another family (Wan2.2-Animate, VACE, Wan-Fun Control) than the
    model is refused before any weights load, and so is one of `samples` (non-E2V ones: check_sample_inputs) with
    inputs the variant cannot take."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ImageEncoderConfig, ModelConfig, PartConfig

    from modules.util.config.ModelConfig import TokenizerConfig
    paths = part_paths or {}
    part = PartConfig(weight_dtype=weight_dtype)
    from modules.util.config.image_encoder_source import looks_like_hub_id
    # a hub id named for sampling (or recorded by a LoRA's header) is asked for: downloads allowed for it
    hub = looks_like_hub_id(base_model_name) or looks_like_hub_id(image_encoder_path)
    config = ModelConfig(
        base_model_name=base_model_name, allow_download=hub,
        transformer=part.model_copy(update={"path": paths.get("transformer", "")}),
        transformer_2=part.model_copy(update={"path": paths.get("transformer_2", "")}),
        text_encoder=part.model_copy(update={"path": paths.get("text_encoder", "")}),
        vae=PartConfig(path=paths.get("vae", "")), tokenizer=TokenizerConfig(path=paths.get("tokenizer", "")),
        image_encoder=ImageEncoderConfig(weight_dtype=weight_dtype, path=image_encoder_path))
    lora_files = [file for path, _ in loras for file in lora_files_named(Path(path))]
    if not hub and (samples or lora_files):
        from modules.modelLoader.wan.parts.model_plan import detect_model_variant
        from modules.util.modelspec import lora_family_refusal
        from modules.util.wan_detection import NotAWanModelError
        try:
            variant = detect_model_variant(config)   # configs and tensor headers only
        except NotAWanModelError:
            if lora_files:   # a LoRA's family cannot be checked: say why
                raise
            variant = None   # the loader names what is wrong with the base model, in its own words
        refusals = [refusal for file in lora_files for refusal in [lora_family_refusal(file, variant)] if refusal]
        if refusals:
            raise SampleError("; ".join(refusals))
        if variant is not None and (problems := variant_problems(variant, samples)):
            raise SampleError("\n  ".join([f"{len(problems)} sample(s) that {variant} cannot take:"] + problems))
    model = WanBaseModelLoader().load(config)
    if not model.variant.has_two_experts:
        model.transformer.to(device)
    return model


def check_sample_files(samples: list[SampleConfig]) -> None:
    """Raises SampleError naming every problem of the enabled samples' files that shows without a model (the VACE /
    Wan-Fun Control control video, mask video and reference images; a first / last frame that is no file), so that
    scripts/sample.py reports them together before any weights load. An Animate sample (one with a pose video) is
    left to the sampler: its mask is as long as its pose video, not as a segment."""
    problems = []
    for sample in (sample for sample in samples if sample.enabled):
        label = f"sample {sample.prompt[:40]!r}"
        problems += [f"{label}: {name} {path!r} does not exist (or is not a file)"
                     for name, path in (("image", sample.image), ("last_image", sample.last_image))
                     if path and not Path(path).is_file()]
        if not sample.pose_video:
            problems += [f"{label}: {problem}" for problem in control_file_problems(
                sample.control_video, sample.mask_video, list(sample.reference_images), round_frames(sample.frames))]
    if problems:
        raise SampleError("\n  ".join([f"{len(problems)} problem(s) with the samples' files:"] + problems))


def variant_problems(variant, samples: list[SampleConfig]) -> list[str]:
    """What keeps each enabled sample from running on `variant` (one sentence a sample at most)."""
    problems = []
    for sample in samples:
        try:
            if sample.enabled:
                check_sample_inputs(variant, sample)
        except SampleError as error:
            problems.append(str(error))
    return problems


def video_file_name(index: int, sample: SampleConfig) -> str:
    from modules.modelSampler.TrainingSampler import prompt_slug
    return f"{index:03d}-{prompt_slug(sample.prompt)}-s{sample.seed}.mp4"


def generate_videos(model: WanModel, samples: list[SampleConfig], output_dir: str | Path, device: torch.device,
                    num_videos: int = 1, show_progress: bool = True,
                    e2v_config: E2VDatasetConfig | None = None, accelerator=None) -> list[Path]:
    """Every enabled sample, `num_videos` times (seed, seed + 1, ...), written as MP4s at the model's native fps to
    `output_dir/<index>-<prompt slug>-s<seed>.mp4`. All samples are checked before the first one runs.
    `e2v_config`: sample an E2V model (see WanModelSampler). `accelerator` (modules/modelSampler/accelerator.py):
    every sample runs with it, and `<video>.json` beside each video records the settings and the accelerator."""
    from tqdm import tqdm

    from modules.util.video_frames import write_video

    sampler = WanModelSampler(model, device=device, e2v_config=e2v_config or model.e2v_config,
                              accelerator=accelerator)
    jobs = [(index, sample.model_copy(update={"seed": sample.seed + k}))
            for index, sample in enumerate(samples) if sample.enabled for k in range(num_videos)]
    # fail fast on a bad sample, before hours of sampling; the steps as they will run (an accelerator's own)
    total_steps = sum(sampler.resolve(sample, log=False)[0].steps for _, sample in jobs)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tqdm(total=total_steps, unit="step", disable=not show_progress) as bar:
        for index, sample in jobs:
            bar.set_description(f"{index:03d} seed {sample.seed}")
            done = [0]

            def on_step(step: int, total: int) -> None:
                bar.update(step - done[0])
                done[0] = step

            result = sampler.sample(sample, on_step=on_step)
            path = output_dir / video_file_name(index, sample)
            write_video(path, result.frames_uint8(), result.fps)
            if result.accelerator is not None:
                from modules.util.atomic import atomic_write_text
                atomic_write_text(path.with_suffix(".json"), json.dumps(
                    {**result.sample.model_dump(mode="json"), "accelerator": result.accelerator}, indent=1) + "\n")
            written.append(path)
    return written
