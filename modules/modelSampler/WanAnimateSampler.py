"""Samples Wan2.2-Animate: a reference character driven by a pose video and a face video (animate mode), or put into
a background video under a mask (replace mode), in segments of `frames` frames for a clip as long as the pose video,
each later segment continued from the previous one's last 1 or 5 frames, as diffusers' `WanAnimatePipeline` does
(same noise draws, conditions from modules/model/animate_condition.py, classifier-free guidance with the face
blanked to -1 for the unconditional pass)."""
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from modules.model import animate_condition as ac
from modules.modelSampler.character_media import read_frames, read_reference
from modules.modelSampler.Placement import Placement
from modules.modelSampler.preserved_state import preserved_state
from modules.modelSampler.SampleResult import SampleError, SampleResult
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant


def animate_problems(variant: WanVariant, sample: SampleConfig) -> list[str]:
    """What keeps `sample` from running on `variant` (empty when it can): each a sentence naming the field. Animate-2's
    own inputs are checked by WanAnimate2Sampler.animate_2_problems."""
    given = {name: getattr(sample, name) for name in ("reference_image", "pose_video", "face_video",
                                                      "background_video", "mask_video", "driving_video")}
    if not variant.is_animate:
        named = [name for name, value in given.items() if value]
        if variant.takes_control_mask:   # VACE's and Fun-Control A14B's own mask video
            named = [name for name in named if name != "mask_video"]
        if variant.is_vace:   # sample.py's one --reference-image fills VACE's list too
            named = [name for name in named
                     if not (name == "reference_image" and list(sample.reference_images) == [sample.reference_image])]
        return [f"{', '.join(named)}: {variant} is not a Wan2.2-Animate model; these are for Animate / Animate-2"] \
            if named else []
    problems = [f"{name} is required for Wan2.2-Animate" for name in ("reference_image", "pose_video", "face_video")
                if not given[name]]
    if given["driving_video"]:
        problems.append("driving_video: Wan2.2-Animate takes a pose video and a face video; the driving video is "
                        "for Wan2.2-Animate-2")
    if sample.animate_mode == "replace":
        problems += [f"{name} is required in replace mode" for name in ("background_video", "mask_video")
                     if not given[name]]
    problems += [f"{name} {value!r} does not exist (or is not a file)" for name, value in given.items()
                 if value and name != "driving_video" and not Path(value).is_file()]
    return problems


@torch.no_grad()
def denoise_animate(model, scheduler, sample: SampleConfig, reference: Image.Image, pose: list, face: list,
                    background: list | None, mask: list | None, prompt_embeds: torch.Tensor,
                    negative_embeds: torch.Tensor | None, device: torch.device, on_step=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The video (1, 3, N, H, W) in [-1, 1] (N = the pose video's length), unclamped as the pipeline decodes it, and
    its normalised latents (1, 16, T, h, w): each segment's without the reference frame and, after the first, without
    the latent frames of the continuation frames, so they encode the padded video the segments make."""
    vae, transformer = model.vae, model.transformer
    height, width, segment, carry = sample.height, sample.width, sample.frames, sample.continuation_frames
    total = len(pose)
    padded, segments = ac.segment_plan(total, segment, carry)
    pose, face = ac.pad_frames(pose, padded), ac.pad_frames(face, padded)
    pose_pixels = ac.video_pixels(pose, height, width).to(device)
    face_size = transformer.config.motion_encoder_size
    face_pixels = ac.video_pixels(face, face_size, face_size).to(device)
    background_pixels = mask_pixels = None
    if sample.animate_mode == "replace":
        background_pixels = ac.video_pixels(ac.pad_frames(background, padded), height, width).to(device)
        mask_pixels = ac.mask_pixels(ac.pad_frames(mask, padded), height, width).to(device)
    dtype = transformer.dtype
    fitted = ac.reference_pixels(reference, height, width).to(device)
    image_embeds = ac.clip_image_tokens(model.image_encoder, fitted).to(device, dtype)
    reference_latents = ac.reference_image_latents(vae, fitted)
    generator = torch.Generator(device="cpu").manual_seed(sample.seed)
    use_cfg = negative_embeds is not None
    latent_frames = (segment - 1) // vae.config.scale_factor_temporal + 1
    spatial = vae.config.scale_factor_spatial
    outputs, generated, previous, start = [], [], None, 0
    for index in range(segments):
        end = start + segment
        # the pipeline's prepare_latents: one draw per segment from the same generator, on the CPU
        latents = torch.randn((1, vae.config.z_dim, latent_frames + 1, height // spatial, width // spatial),
                              generator=generator, dtype=torch.float32).to(device)
        condition = ac.segment_condition_latents(
            vae, segment, height, width, carry, sample.animate_mode, previous,
            None if background_pixels is None else background_pixels[:, :, start:end],
            None if mask_pixels is None else mask_pixels[:, :, start:end], continuing=start > 0)
        condition = torch.cat([reference_latents, condition], dim=2)
        pose_latents = ac.pose_latents(vae, pose_pixels[:, :, start:end]).to(dtype)
        face_segment = face_pixels[:, :, start:end].to(dtype)
        scheduler.set_timesteps(sample.steps, device=device)
        for step, t in enumerate(scheduler.timesteps):
            model_input = torch.cat([latents, condition], dim=1).to(dtype)
            timestep = t.expand(latents.shape[0])
            prediction = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=prompt_embeds,
                                     encoder_hidden_states_image=image_embeds, pose_hidden_states=pose_latents,
                                     face_pixel_values=face_segment, return_dict=False)[0]
            if use_cfg:
                unconditional = transformer(hidden_states=model_input, timestep=timestep,
                                            encoder_hidden_states=negative_embeds,
                                            encoder_hidden_states_image=image_embeds,
                                            pose_hidden_states=pose_latents, face_pixel_values=face_segment * 0 - 1,
                                            return_dict=False)[0]
                prediction = unconditional + sample.guidance * (prediction - unconditional)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step(index * sample.steps + step + 1, segments * sample.steps)
        # latent frame 0 is the reference: dropped before decoding
        frames = vae.decode(ac.denormalise(vae, latents.to(vae.dtype))[:, :, 1:], return_dict=False)[0]
        condition_frames = ac.condition_latent_frames(carry, start > 0, vae.config.scale_factor_temporal)
        generated.append(latents[:, :, condition_frames:])
        previous = frames[:, :, -carry:].clone()
        outputs.append(frames[:, :, carry:] if start > 0 else frames)
        start += segment - carry
    return torch.cat(outputs, dim=2)[:, :, :total], torch.cat(generated, dim=2)


def sample_animate(sampler, resolved: SampleConfig, on_step=None):
    """One Animate sample through `sampler` (a WanModelSampler: device, scheduler, text encoding, placement)."""
    model = sampler.model
    problems = animate_problems(model.variant, resolved)
    if problems:
        raise SampleError(f"sample {resolved.prompt[:40]!r}: " + "; ".join(problems))
    reference, pose, face = read_reference(resolved.reference_image), read_frames(resolved.pose_video), \
        read_frames(resolved.face_video)
    background = read_frames(resolved.background_video) if resolved.animate_mode == "replace" else None
    mask = read_frames(resolved.mask_video) if resolved.animate_mode == "replace" else None
    short = [f"{name} has {len(frames)} frames, the pose video {len(pose)}"
             for name, frames in (("face_video", face), ("background_video", background), ("mask_video", mask))
             if frames is not None and len(frames) < len(pose)]
    if short:
        raise SampleError(f"sample {resolved.prompt[:40]!r}: " + "; ".join(short) + " (frame-aligned companions)")
    if len(pose) <= resolved.continuation_frames:
        raise SampleError(f"pose_video {resolved.pose_video!r}: {len(pose)} frames; more than "
                          f"{resolved.continuation_frames} needed")
    placement = Placement(model, sampler.device)
    with preserved_state(model, sampler.device):
        try:
            prompt_embeds, negative_embeds = placement.encode_prompts(model, resolved, resolved.guidance > 1.0)
            placement.materialize("image_encoder", "vae", "transformer")
            scheduler = sampler.make_scheduler(resolved.scheduler, resolved.flow_shift)
            with sampler._transformer_autocast():
                video, latents = denoise_animate(model, scheduler, resolved, reference, pose, face, background,
                                                 mask, prompt_embeds, negative_embeds, sampler.device, on_step)
        finally:
            placement.restore()
    frames = (video[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).cpu().numpy()
    return SampleResult(frames=frames.astype(np.float32), fps=model.variant.native_fps, sample=resolved,
                        notes=[], latents=latents[0].float().cpu())
