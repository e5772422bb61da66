"""Samples Wan2.2-Animate-2: the reference character moving as the driving video, as long as the driving video, in
segments of `frames` frames each continued from the previous one's last 1 or 5 frames, exactly as diffusers' modular
`WanAnimate2ModularPipeline` does: its own preprocess blocks (the output size from the target area and the reference
image's aspect ratio, letterboxing, the driving video's zigzag padding to whole segments) and its decode block (trim,
crop the letterbox bars off), the conditions and the two transformer passes of modules/model/animate_2_condition.py,
the same noise draws, and classifier-free guidance whose unconditional branch skips the transformer's block 9 (the
pipeline's guider). Guidance 1 or less runs the conditional branch only, as the distilled release samples."""
from pathlib import Path

import numpy as np
import torch

from modules.model import animate_2_condition as a2
from modules.model.animate_2_attention import use_training_attention
from modules.model.animate_condition import condition_latent_frames
from modules.model.WanModel import TEXT_SEQUENCE_LENGTH
from modules.modelSampler.character_media import read_frames, read_reference
from modules.modelSampler.Placement import Placement
from modules.modelSampler.preserved_state import preserved_state
from modules.modelSampler.SampleResult import SampleError, SampleResult
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant

ANIMATE_FIELDS = ("pose_video", "face_video", "background_video", "mask_video")   # Wan2.2-Animate's own inputs


def animate_2_problems(variant: WanVariant, sample: SampleConfig) -> list[str]:
    """What keeps `sample` from running on Animate-2 `variant` (empty when it can): each a sentence naming the field.
    (Animate-2 inputs given to another variant: WanAnimateSampler.animate_problems.)"""
    problems = [f"{name} is required for Wan2.2-Animate-2" for name in ("reference_image", "driving_video")
                if not getattr(sample, name)]
    animate_only = [name for name in ANIMATE_FIELDS if getattr(sample, name)]
    if animate_only:
        problems.append(f"{', '.join(animate_only)}: Wan2.2-Animate-2 takes a driving video, not Wan2.2-Animate's "
                        f"pose / face / background / mask videos")
    if sample.animate_mode != "animate":
        problems.append(f"animate_mode {sample.animate_mode!r}: Wan2.2-Animate-2 has no replace mode")
    problems += [f"{name} {getattr(sample, name)!r} does not exist (or is not a file)"
                 for name in ("reference_image", "driving_video")
                 if getattr(sample, name) and not Path(getattr(sample, name)).is_file()]
    return problems


def _preprocess(reference, driving: list, sample: SampleConfig, driving_fps: float | None, fps: int) -> dict:
    """The pipeline's own preprocess blocks: the letterboxed reference (1, 3, H, W), the crop box, the resolved size,
    the driving video resampled from `driving_fps` (None: as stored) to the model's `fps` (nearest frame), zigzag
    padded to whole segments (1, 3, N', H, W) in [-1, 1], its real length and the segment count; on the CPU (the
    driving video moves to the device a segment at a time)."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import (WanAnimate2ProcessImagesInputStep,
                                                                     WanAnimate2ProcessVideosInputStep)
    image = WanAnimate2ProcessImagesInputStep().init_pipeline()(
        image=reference, height=sample.height, width=sample.width,
        output=["image_pixels", "crop_region", "height", "width"])
    video = WanAnimate2ProcessVideosInputStep().init_pipeline()(
        driving_video=driving, driving_video_fps=driving_fps, fps=fps, segment_frame_length=sample.frames,
        prev_segment_conditioning_frames=sample.continuation_frames, height=image["height"], width=image["width"],
        output=["driving_video_pixels", "real_frame_len", "num_segments", "effective_segment"])
    return {**image, **video}


@torch.no_grad()
def denoise_animate_2(model, scheduler, sample: SampleConfig, inputs: dict, prompt_embeds: torch.Tensor,
                      negative_embeds: torch.Tensor | None, reference_prompt_embeds: torch.Tensor, device,
                      on_step=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each segment's decoded frames (1, 3, n, H, W) in [-1, 1] (later segments without their continuation frames)
    and the generated latents (1, 16, T', h, w) without the reference frame and the continuation frames."""
    from diffusers.modular_pipelines.wan_animate_2.denoise import decode_vae

    vae, transformer = model.vae, model.transformer
    image_pixels, driving = inputs["image_pixels"].to(device), inputs["driving_video_pixels"]
    frames, carry, segments = sample.frames, sample.continuation_frames, inputs["num_segments"]
    geometry = a2.segment_geometry(frames, inputs["height"], inputs["width"], vae.config.scale_factor_spatial,
                                   vae.config.scale_factor_temporal)
    image_clip = a2.clip_tokens(model.image_encoder, image_pixels[0])
    driving_clip = a2.clip_tokens(model.image_encoder, driving[0, :, 0].to(device))
    image_latents = a2.reference_image_latents(vae, image_pixels)
    generator = torch.Generator(device="cpu").manual_seed(sample.seed)
    outputs, generated, previous = [], [], None
    for index in range(segments):
        start = index * inputs["effective_segment"]
        driving_latents, driving_condition = a2.driving_condition(vae, driving[:, :, start:start + frames].to(device))
        reference = a2.reference_latents(vae, image_latents, frames, previous)
        # the pipeline's draw: one per segment, (16, T + 1, h, w) from the same CPU generator
        latents = torch.randn((vae.config.z_dim, *reference.shape[2:]), generator=generator,
                              dtype=torch.float32).to(device)[None]
        scheduler.set_timesteps(sample.steps, device=device)
        cache = a2.extract_pass(transformer, driving_latents, driving_condition, reference_prompt_embeds,
                                driving_clip, geometry, scheduler.timesteps[:1])
        for step, t in enumerate(scheduler.timesteps):
            timestep = t[None]
            prediction = a2.cached_pass(transformer, latents, reference, prompt_embeds, image_clip, cache, timestep,
                                        geometry)
            if negative_embeds is not None:
                unconditional = a2.cached_pass(transformer, latents, reference, negative_embeds, image_clip, cache,
                                               timestep, geometry, unconditional=True)
                prediction = unconditional + sample.guidance * (prediction - unconditional)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step(index * sample.steps + step + 1, segments * sample.steps)
        cache.clear()
        # latent frame 0 is the reference image's slot, not video
        decoded = decode_vae(vae, latents.float()[:, :, 1:])
        generated.append(latents[:, :, condition_latent_frames(carry, index > 0, vae.config.scale_factor_temporal):])
        if index > 0:
            decoded = decoded[:, :, carry:]
        outputs.append(decoded.cpu())
        previous = decoded[:, :, -carry:]
    return outputs, torch.cat(generated, dim=2)


def encode_animate_2_prompts(model, sample: SampleConfig, use_cfg: bool, device):
    """(prompt, negative or None, reference prompt) UMT5 states (1, 512, 4096) as the pipeline encodes them (the
    prompt exactly as given, no whitespace cleaning)."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import get_t5_prompt_embeds

    def encode(text: str) -> torch.Tensor:
        return get_t5_prompt_embeds(model.text_encoder, model.tokenizer, text, TEXT_SEQUENCE_LENGTH, device)

    return (encode(sample.prompt), encode(sample.negative_prompt or "") if use_cfg else None,
            encode(sample.reference_prompt or a2.REFERENCE_PROMPT))


def sample_animate_2(sampler, resolved: SampleConfig, on_step=None) -> SampleResult:
    """One Animate-2 sample through `sampler` (a WanModelSampler: device, scheduler, placement)."""
    model = sampler.model
    problems = animate_2_problems(model.variant, resolved)
    if problems:
        raise SampleError(f"sample {resolved.prompt[:40]!r}: " + "; ".join(problems))
    from modules.util.video_io import probe_media
    reference, driving = read_reference(resolved.reference_image), read_frames(resolved.driving_video)
    inputs = _preprocess(reference, driving, resolved, probe_media(resolved.driving_video).fps,
                         model.variant.native_fps)
    real = inputs["real_frame_len"]
    # the pipeline pads the last segment with the driving video's own last frames, mirrored: with fewer frames than
    # the padding needs, the padded video is not whole segments
    whole = inputs["num_segments"] * inputs["effective_segment"] + resolved.continuation_frames
    if real <= resolved.continuation_frames or inputs["driving_video_pixels"].shape[2] != whole:
        raise SampleError(f"driving_video {resolved.driving_video!r}: {real} frames at {model.variant.native_fps} fps, "
                          f"too few for segments of {resolved.frames} frames: give at least {resolved.frames} frames "
                          f"or lower frames")
    use_cfg = resolved.guidance > 1.0
    placement = Placement(model, sampler.device)
    with preserved_state(model, sampler.device):
        try:
            with placement.using("text_encoder"):
                prompts = encode_animate_2_prompts(model, resolved, use_cfg, sampler.device)
            placement.materialize("image_encoder", "vae", "transformer")
            if sampler.device.type == "cuda":
                # diffusers' processor runs flex attention uncompiled unless the caller compiles the blocks, and
                # uncompiled flex attention holds the whole score matrix (hundreds of GiB at 81 frames of 480p);
                # the training processor computes the same attention through compiled flex attention
                use_training_attention(model.transformer)
            scheduler = sampler.make_scheduler(resolved.scheduler, resolved.flow_shift)
            with sampler._transformer_autocast():
                segments, latents = denoise_animate_2(model, scheduler, resolved, inputs, *prompts,
                                                      device=sampler.device, on_step=on_step)
        finally:
            placement.restore()
    frames = finish_video(segments, inputs["real_frame_len"], inputs["crop_region"])
    notes = []
    if frames.shape[1:3] != (resolved.height, resolved.width):
        notes.append(f"{frames.shape[2]} x {frames.shape[1]}: the area of {resolved.width} x {resolved.height} at the "
                     f"reference image's aspect ratio, as the pipeline sizes Animate-2's output")
    return SampleResult(frames=frames, fps=model.variant.native_fps, sample=resolved, notes=notes,
                        latents=latents[0].float().cpu())


def finish_video(segments: list[torch.Tensor], real_frames: int, crop_region) -> np.ndarray:
    """The pipeline's decode block: the segments joined, trimmed to the driving video's length, the letterbox bars
    cropped off -> float32 (N, H, W, 3) in [0, 1]."""
    from diffusers.modular_pipelines.wan_animate_2.decoders import WanAnimate2DecodeStep

    videos = WanAnimate2DecodeStep().init_pipeline()(segment_frames=segments, real_frame_len=real_frames,
                                                    crop_region=crop_region, output_type="np", output="videos")
    return np.asarray(videos[0], dtype=np.float32)
