"""WanModelSampler: videos from a WanModel through diffusers' own Wan pipelines, assembled from the live parts.

No copy of the weights and no denoising loop of our own: `WanModel.create_pipeline` builds a `WanPipeline`
(text-to-video: T2V, T2V-A14B, TI2V-5B without an image) or a `WanImageToVideoPipeline` (I2V, FLF2V, I2V-A14B,
TI2V-5B with an image, which uses `expand_timesteps`) around the very modules that train, so peft adapters being
trained act at their current weights and a two-expert model runs both experts (the frozen one too).

What is ours, around the pipeline call:
- the text (UMT5) and CLIP embeddings are computed with `WanModel.encode_text` / `encode_image`, the functions that
  training uses, and handed to the pipeline as `prompt_embeds` / `image_embeds`;
- a fresh scheduler per call, built from `model.noise_scheduler.config` with the sample's flow shift (the model's
  scheduler is never mutated);
- the pipeline returns latents (`output_type="latent"`) and `WanModel.decode_latents` decodes them;
- placement: a part that is not on the sampling device is moved there only while it is used and moved back after
  (text encoder for the prompt, CLIP for the images, VAE for the image condition and the decode, each A14B expert
  for its own denoising stage), and every other piece of state is restored as it was (train/eval modes,
  requires_grad, peft adapter enable flags, the global RNGs).

Elements-to-Video (DESIGN.md 6.11): given an `E2VDatasetConfig` (`e2v_config=`, the one the model trains with),
every sample is an E2V sample. Its element images (`SampleConfig.elements`, name -> path) are preprocessed exactly as
the data loader does (VAE pathway at the sample's size, CLIP pathway at processors.clip.resolution), the condition
and CLIP tokens are built with the shared functions of modules/model/e2v_condition.py, and `WanE2VPipeline` (the I2V
pipeline's own loop with that condition) denoises. Every given reference is used; absent elements leave their slot
empty. `drop_reference_frames` drops the leading reference frames from the returned video.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from modules.model.WanModel import WanModel
from modules.model.released_parts import prompts_remembered, text_encoder_loaded
from modules.model.sampling_defaults import sample_updates
from modules.modelSampler.accelerator import Accelerator, accelerated
from modules.modelSampler.Placement import Placement, _device_of
from modules.modelSampler.preserved_state import preserved_state
from modules.modelSampler.SampleResult import SampleError, SampleResult  # noqa: F401  (re-exported)
from modules.modelSampler.WanAnimate2Sampler import animate_2_problems, sample_animate_2
from modules.modelSampler.WanAnimateSampler import animate_problems, sample_animate
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.enum.WanVariant import WanVariant
from modules.util.registry import register

logger = logging.getLogger(__name__)

NUM_TRAIN_TIMESTEPS = 1000


# ---------------------------------------------------------------------------------------------- rounding

def round_to_multiple(value: int, unit: int) -> int:
    """Nearest multiple of `unit` (halves round up), at least `unit`."""
    return max(unit, (value + unit // 2) // unit * unit)


def round_frames(frames: int, temporal_stride: int = 4) -> int:
    """Nearest 4k+1 (halves round up), at least 1."""
    k = (frames - 1 + temporal_stride // 2) // temporal_stride
    return max(0, k) * temporal_stride + 1


def check_sample_inputs(variant: WanVariant, sample: SampleConfig) -> None:
    """Raises SampleError when `variant` cannot take the inputs a (non-E2V) sample gives or lacks one it needs: the
    variant alone decides, so scripts/sample.py asks before any weights load (configs and headers tell the variant)."""
    image, last_image = sample.image, sample.last_image
    from modules.modelSampler.vace_sampling import VaceInputError, check_vace_sample
    try:
        check_vace_sample(variant, sample)
    except VaceInputError as error:
        raise SampleError(str(error)) from None
    if problems := (animate_2_problems if variant.takes_driving_video else animate_problems)(variant, sample):
        raise SampleError(f"sample {sample.prompt[:40]!r}: " + "; ".join(problems))
    if variant in (WanVariant.T2V, WanVariant.T2V_A14B) and (image or last_image):
        raise SampleError(f"sample {sample.prompt[:40]!r}: {variant} is a text-to-video model and takes no "
                          f"image; remove image / last_image")
    if variant.takes_image_condition and not image:
        raise SampleError(f"sample {sample.prompt[:40]!r}: {variant} needs a first frame: set image")
    if variant is WanVariant.FLF2V and not last_image:
        raise SampleError(f"sample {sample.prompt[:40]!r}: FLF2V needs a last frame: set last_image")
    if last_image and variant not in (WanVariant.FLF2V, WanVariant.I2V_A14B):
        raise SampleError(f"sample {sample.prompt[:40]!r}: {variant} takes no last frame (last_image is for "
                          f"FLF2V and I2V-A14B)")


# ---------------------------------------------------------------------------------------------- the sampler

@register("model_sampler", [ModelType.WAN_2_1, ModelType.WAN_2_2], list(TrainingMethod))
class WanModelSampler:
    def __init__(self, model: WanModel, device: torch.device | str | None = None,
                 autocast_dtype: torch.dtype | None = None, e2v_config: E2VDatasetConfig | None = None,
                 accelerator: Accelerator | None = None):
        """`device`: where the denoising runs (default: the main transformer's device). `autocast_dtype`: run each
        transformer forward under torch.autocast in this dtype (the trainer passes its train dtype so previews compute
        as training does); None or float32: no autocast. `e2v_config`: the E2V dataset config the model trains
        with; given, every sample is an Elements-to-Video sample. `accelerator`: every sample runs with it, on its
        schedule and steps, guidance 1 (modules/modelSampler/accelerator.py)."""
        self.model = model
        self.accelerator = accelerator
        self.e2v_config = e2v_config
        device = torch.device(device) if device is not None else \
            (_device_of(model.main_transformer) or torch.device("cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # compare equal to the parts' devices
        self.device = device
        self.autocast_dtype = None if autocast_dtype in (None, torch.float32) else autocast_dtype

    # ---- settings ----------------------------------------------------------------------------------------------

    def default_flow_shift(self) -> float:
        config = self.model.noise_scheduler.config
        shift = config.get("flow_shift", None)
        if shift is None:
            shift = config.get("shift", None)
        return float(shift if shift is not None else 1.0)

    def resolve(self, sample: SampleConfig, log: bool = True) -> tuple[SampleConfig, list[str]]:
        """The sample as it will run: sides rounded to the model's spatial unit, frames to 4k+1 (each rounding
        noted, and logged as a warning when `log`), the flow shift filled in; raises SampleError for images the
        variant cannot take, missing images or missing paths."""
        model, variant, notes = self.model, self.model.variant, []
        unit = model.spatial_unit
        width, height = round_to_multiple(sample.width, unit), round_to_multiple(sample.height, unit)
        frames = round_frames(sample.frames, model.vae_temporal_stride)
        if (width, height) != (sample.width, sample.height):
            notes.append(f"size {sample.width}x{sample.height} rounded to {width}x{height} "
                         f"(sides must be multiples of {unit} for {variant})")
        if frames != sample.frames:
            notes.append(f"frames {sample.frames} rounded to {frames} (frame counts must be 4k+1)")

        image, last_image = sample.image, sample.last_image
        if self.is_e2v(sample):
            notes += self._check_e2v(sample, frames)
        else:
            if sample.drop_reference_frames:
                notes.append("drop_reference_frames ignored: not an E2V sample")
            check_sample_inputs(variant, sample)
            if variant.is_vace and sample.mask_video and not sample.control_video:
                notes.append("mask_video ignored: without a control video everything is generated (the official "
                             "VACE code then uses an all-ones mask)")
        for label, path in (("image", image), ("last_image", last_image)):
            if path and not Path(path).is_file():
                raise SampleError(f"sample {label} {path!r} does not exist (or is not a file)")

        guidance_2 = sample.guidance_2
        if guidance_2 is not None and not variant.has_two_experts:
            notes.append(f"guidance_2 {guidance_2} ignored: {variant} has one expert")
            guidance_2 = None
        flow_shift = sample.flow_shift if sample.flow_shift is not None else self.default_flow_shift()
        # an official-release / ComfyUI base: the variant's official settings fill in what the sample left unset
        official = sample_updates(model.sampling_defaults, sample, width, height)
        resolved = sample.model_copy(update=dict(dict(width=width, height=height, frames=frames, guidance_2=guidance_2,
                                                      flow_shift=flow_shift), **official))
        if self.accelerator is not None:   # its own schedule, no negative pass
            if variant.is_animate or variant.takes_driving_video:
                raise SampleError(f"an accelerator is not supported for {variant} samples")
            resolved = resolved.model_copy(update=dict(
                steps=self.accelerator.steps, guidance=1.0, flow_shift=self.accelerator.config.shift,
                guidance_2=1.0 if variant.has_two_experts else None))
        for note in notes if log else ():
            logger.warning("sample %r: %s", sample.prompt[:40], note)
        return resolved, notes

    # ---- Elements-to-Video ------------------------------------------------------------------------------------

    def is_e2v(self, sample: SampleConfig) -> bool:
        """With an E2V config every sample is an E2V sample (absent elements leave their slots empty)."""
        return self.e2v_config is not None or bool(sample.elements)

    def reference_frames_to_drop(self) -> int:
        """The leading reference frames of an E2V video: every slot's repeats (absent elements' slots too: the
        training target holds them as grey frames) with reference_frames 'prepend'; 0 with 'overlay'."""
        config = self.e2v_config
        return config.num_reference_frames if config.reference_frames == "prepend" else 0

    def _check_e2v(self, sample: SampleConfig, frames: int) -> list[str]:
        from modules.util.config.config_io import ConfigError
        from modules.util.config.E2VConfig import check_against_frames

        config, model, label = self.e2v_config, self.model, f"sample {sample.prompt[:40]!r}"
        if config is None:
            raise SampleError(f"{label}: elements {sorted(sample.elements)} need E2V sampling: pass the E2V dataset "
                              f"config the model trains with (WanModelSampler(e2v_config=...), scripts/sample.py "
                              f"--e2v-config)")
        if sample.image or sample.last_image:
            raise SampleError(f"{label}: an E2V sample takes its references from elements; remove image / "
                              f"last_image")
        names = [element.name for element in config.elements_in_position_order()]
        unknown = sorted(set(sample.elements) - set(names))
        if unknown:
            raise SampleError(f"{label}: element(s) {unknown} are not in the E2V config (its elements: "
                              f"{', '.join(names)})")
        for name, path in sample.elements.items():
            if not path or not Path(path).is_file():
                raise SampleError(f"{label}: element {name!r} image {path!r} does not exist (or is not a file)")
        missing = [element.name for element in config.elements if element.required and element.name not in
                   sample.elements]
        if missing:
            raise SampleError(f"{label}: required element(s) {missing} have no image (set elements)")
        if model.expand_timesteps:
            raise SampleError(f"{label}: E2V sampling does not support {model.variant}")
        latent, stride = model.latent_channels, model.vae_temporal_stride
        expected = latent + config.condition_channels(latent, stride)
        for transformer in (model.transformer, model.transformer_2):
            if transformer is not None and transformer.config.in_channels != expected:
                raise SampleError(f"{label}: the transformer takes {transformer.config.in_channels} input channels; "
                                  f"E2V with this config needs {expected} ({latent} latent + "
                                  f"{expected - latent} condition, concatenate_mask "
                                  f"{config.processors.vae.concatenate_mask})")
        if config.uses_clip and not model.uses_image_tokens:
            raise SampleError(f"{label}: e2v_type {config.e2v_type!r} uses CLIP tokens, but the transformer has no "
                              f"image branch")
        if config.uses_clip and (model.image_encoder is None or model.image_processor is None):
            raise SampleError(f"{label}: e2v_type {config.e2v_type!r} needs the CLIP image encoder, which this model "
                              f"does not have loaded")
        try:
            check_against_frames(config, frames)
        except ConfigError as error:
            raise SampleError(f"{label}: " + "; ".join(error.problems)) from None
        notes = []
        if sample.drop_reference_frames:
            drop = self.reference_frames_to_drop()
            if drop >= frames:
                raise SampleError(f"{label}: dropping the {drop} reference frames leaves none of its {frames} frames")
            if drop == 0:
                notes.append("drop_reference_frames: nothing to drop (reference_frames 'overlay')")
        return notes

    def _e2v_inputs(self, sample: SampleConfig, placement: Placement) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the condition (C, T, h, w), the CLIP tokens (N * tokens, dim) or None), computed exactly as the data
        loader computes them (modules/dataLoader/pipeline/EncodeE2V.py) with processors.vae.resolution replaced by the
        sample's size, every given element kept (frame_conditioning 'full')."""
        from modules.model.e2v_condition import clip_tokens, make_e2v_condition, prepare_element_inputs
        from modules.util.video_io import UnreadableMediaError, read_image

        config, model = self.e2v_config, self.model
        height, width = sample.height, sample.width
        order = config.elements_in_position_order()
        images = []
        for element in order:
            path = sample.elements.get(element.name)
            try:
                images.append(read_image(path) if path else None)
            except UnreadableMediaError as error:
                raise SampleError(f"element {element.name!r} image {path!r} cannot be read: {error.reason}") from error
        vae = config.processors.vae
        vae_elements, clip_images = prepare_element_inputs(config, images, height, width)
        if config.uses_vae:
            elements, combine = vae_elements, vae.combine
        else:
            # the CLIP pathway alone: an empty condition (grey latents, mask 0), as in training
            elements, combine = [None] * len(order), "before"
        with placement.using("vae"):
            condition = make_e2v_condition(model, elements, config.repeats(), sample.frames, combine,
                                           vae.concatenate_mask, height=height, width=width)
        tokens = None
        if config.uses_clip:
            with placement.using("image_encoder"):
                tokens = clip_tokens(model, clip_images)
        return condition, tokens

    def make_scheduler(self, name: str, flow_shift: float):
        """A fresh flow-matching scheduler (UNIPC or EULER) from the model's scheduler config with `flow_shift`; with
        an accelerator, its own schedule."""
        if self.accelerator is not None:
            return self.accelerator.scheduler()
        from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

        config = self.model.noise_scheduler.config
        train_steps = int(config.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS))
        if name == "UNIPC":
            if isinstance(self.model.noise_scheduler, UniPCMultistepScheduler):
                return UniPCMultistepScheduler.from_config(config, flow_shift=flow_shift)
            return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                           num_train_timesteps=train_steps, flow_shift=flow_shift)
        if name == "EULER":
            if isinstance(self.model.noise_scheduler, FlowMatchEulerDiscreteScheduler):
                return FlowMatchEulerDiscreteScheduler.from_config(config, shift=flow_shift)
            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=train_steps, shift=flow_shift)
        raise SampleError(f"unknown sampling scheduler {name!r}: UNIPC or EULER")

    # ---- sampling ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transformer_autocast(self) -> Iterator[None]:
        """torch.autocast around each transformer forward only (as training runs it; the text encoder, the VAE and
        the scheduler's math keep their own precision), its output cast to float32 as training's prediction is."""
        if self.autocast_dtype is None:
            yield
            return
        active: list = []

        def enter(module, args, kwargs):
            context = torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)
            context.__enter__()
            active.append(context)

        def leave(module, args, kwargs, output):
            active.pop().__exit__(None, None, None)
            if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
                return (output[0].float(), *output[1:])
            return output

        handles = []
        for transformer in (self.model.transformer, self.model.transformer_2):
            if transformer is not None:
                handles.append(transformer.register_forward_pre_hook(enter, with_kwargs=True))
                handles.append(transformer.register_forward_hook(leave, with_kwargs=True, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            while active:
                active.pop().__exit__(None, None, None)

    def _vace_context(self, sample: SampleConfig, placement: Placement) -> tuple[torch.Tensor, int]:
        from modules.modelSampler.vace_sampling import VaceInputError, sample_context
        try:
            with placement.using("vae"):
                context, references = sample_context(self.model, sample)
        except VaceInputError as error:
            raise SampleError(str(error)) from None
        return context.to(self.device), references

    @staticmethod
    def _load_image(path: str, height: int, width: int):
        """The image scaled to cover height x width and centre-cropped (as the data path crops clips)."""
        from PIL import Image

        from modules.util.video_io import UnreadableMediaError, read_image
        from modules.util.video_frames import resize_and_crop
        try:
            pixels = read_image(path)
        except UnreadableMediaError as error:
            raise SampleError(f"sample image {path!r} cannot be read: {error.reason}") from error
        return Image.fromarray(resize_and_crop(pixels[None], height, width)[0])

    def _expert_plan(self, scheduler_name: str, flow_shift: float, steps: int) -> list[str]:
        """Which transformer each denoising step uses, exactly as the pipeline chooses it."""
        if self.model.boundary_ratio is None or self.model.transformer_2 is None:
            return ["transformer"] * steps
        probe = self.make_scheduler(scheduler_name, flow_shift)
        probe.set_timesteps(steps, device="cpu")
        boundary = self.model.boundary_ratio * probe.config.num_train_timesteps
        return ["transformer" if t >= boundary else "transformer_2" for t in probe.timesteps]

    def _prompts_kept(self, resolved: SampleConfig) -> bool:
        """Whether the sample's prompts are kept (released_parts.prompts_ready), so it needs no text encoder.
        Animate-2 encodes its prompts its own way (no whitespace cleaning, a reference prompt): it always reads it."""
        return not self.model.variant.takes_driving_video and prompts_remembered(
            self.model, [resolved.prompt] + ([resolved.effective_negative_prompt] if resolved.guidance > 1.0 else []))

    def sample(self, sample: SampleConfig, on_step: Callable[[int, int], None] | None = None) -> SampleResult:
        """One video. `on_step(done, total)` is called after every denoising step."""
        model = self.model
        if model.text_encoder is None and model.text_encoder_loader is not None \
                and not self._prompts_kept(self.resolve(sample, log=False)[0]):
            with text_encoder_loaded(model):   # released after caching: read again for this sample
                return self.sample(sample, on_step)
        resolved, notes = self.resolve(sample)
        variant = model.variant
        if variant.takes_driving_video:
            return sample_animate_2(self, resolved, on_step)
        if variant.is_animate:
            return sample_animate(self, resolved, on_step)
        if variant.has_two_experts and (model.transformer is None or model.transformer_2 is None):
            raise SampleError(f"{variant} needs both experts loaded to sample")
        if (model.text_encoder is None and not self._prompts_kept(resolved)) or model.vae is None:
            raise SampleError("sampling needs the text encoder and the VAE; this model has them unloaded")
        e2v = self.is_e2v(resolved)
        fun = variant.is_fun_control   # its start image is part of its own condition (fun_sampling.py)
        image_mode = not e2v and not fun and (variant.takes_image_condition or bool(resolved.image))
        height, width = resolved.height, resolved.width
        first = self._load_image(resolved.image, height, width) if resolved.image else None
        last = self._load_image(resolved.last_image, height, width) if resolved.last_image else None
        use_cfg = resolved.guidance > 1.0
        plan = self._expert_plan(resolved.scheduler, resolved.flow_shift, resolved.steps)
        placement = Placement(model, self.device)

        with preserved_state(model, self.device):
            try:
                prompt_embeds, negative_embeds = placement.encode_prompts(model, resolved, use_cfg)
                image_embeds = e2v_condition = None
                if e2v:
                    e2v_condition, image_embeds = self._e2v_inputs(resolved, placement)
                elif fun:
                    from modules.modelSampler.fun_sampling import fun_inputs
                    e2v_condition, image_embeds = fun_inputs(model, resolved, first, placement, self.device)
                if image_mode and model.image_encoder is not None and model.uses_image_tokens:
                    with placement.using("image_encoder"):
                        image_embeds = model.encode_image([first] if last is None else [first, last]).to(self.device)

                vace = self._vace_context(resolved, placement) if variant.is_vace else None
                if e2v or fun:   # the I2V loop with a precomputed condition
                    from modules.modelSampler.WanE2VPipeline import WanE2VPipeline
                    pipeline = WanE2VPipeline.from_model(model)
                elif vace is not None:
                    from modules.modelSampler.WanVACEContextPipeline import WanVACEContextPipeline
                    pipeline = WanVACEContextPipeline.from_model(model, *vace)
                else:
                    pipeline = model.create_pipeline(image_mode=image_mode, with_text_encoder=False)
                pipeline.scheduler = self.make_scheduler(resolved.scheduler, resolved.flow_shift)
                pipeline.set_progress_bar_config(disable=True)

                def step_end(pipe, index: int, timestep, callback_kwargs: dict) -> dict:
                    if index == 0:
                        placement.evict("vae")  # the image condition is encoded before the first step
                    if index + 1 < len(plan) and plan[index + 1] != plan[index]:
                        placement.evict(plan[index])
                        placement.materialize(plan[index + 1])
                    if on_step is not None:
                        on_step(index + 1, len(plan))
                    return {}

                kwargs = dict(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_embeds, height=height,
                              width=width, num_frames=resolved.frames, num_inference_steps=resolved.steps,
                              guidance_scale=resolved.guidance,
                              generator=torch.Generator(device="cpu").manual_seed(resolved.seed),
                              output_type="latent", callback_on_step_end=step_end)
                if variant.has_two_experts:
                    kwargs["guidance_scale_2"] = resolved.guidance_2
                if vace is not None:
                    kwargs.update(conditioning_scale=resolved.control_scale)
                if e2v or fun:
                    kwargs.update(e2v_condition=e2v_condition, image_embeds=image_embeds)
                if image_mode:
                    kwargs.update(image=first, last_image=last)
                    if image_embeds is not None:
                        # diffusers 0.42's I2V pipeline refuses `image_embeds` together with `image` (and needs
                        # `image` for the VAE condition), so the CLIP tokens computed above are handed over through
                        # the one method it calls for them
                        pipeline.encode_image = lambda images, device=None: image_embeds.to(device or self.device)
                    placement.materialize("vae")
                placement.materialize(plan[0])
                with self._transformer_autocast(), accelerated(model, self.accelerator):
                    latents = pipeline(**kwargs).frames
                if vace is not None:   # the reference frames lead the latents; the video follows them
                    latents = latents[:, :, vace[1]:]
                placement.evict("transformer", "transformer_2", "vae")
                del pipeline

                with placement.using("vae"):
                    video = model.decode_latents(latents)  # (1, 3, F, H, W) in [-1, 1]
            finally:
                placement.restore()
        frames = (video[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).cpu().numpy()
        if e2v and resolved.drop_reference_frames:
            frames = frames[self.reference_frames_to_drop():]
        return SampleResult(frames=frames, fps=variant.native_fps, sample=resolved, notes=notes,
                            latents=latents[0].float().cpu(),
                            accelerator=self.accelerator.record() if self.accelerator is not None else None)
