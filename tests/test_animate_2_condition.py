"""Animate-2's conditioning (modules/model/animate_2_condition.py) equals the tensors diffusers' modular
`WanAnimate2ModularPipeline` builds, in fp32 on the tiny model: the driving-video condition, the reference latents of a
first segment and of continuation segments (1 and 5 carried frames), the extract pass's KV cache and a guided
denoising step of the cached pass (both branches; the tiny model has 2 blocks, so the unconditional branch's
skipped block 9 does not exist here: the branches differ by their prompts)."""
import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanAnimate2Transformer3DModel
from diffusers.modular_pipelines.modular_pipeline import BlockState
from diffusers.modular_pipelines.wan_animate_2.denoise import (WanAnimate2RefExtractStep,
                                                                WanAnimate2SegmentDenoiseInner,
                                                                WanAnimate2SegmentPrevFramesStep,
                                                                WanAnimate2SegmentVaeEncoderStep)
from diffusers.modular_pipelines.wan_animate_2.encoders import WanAnimate2ImageVaeEncoderStep

from modules.model import animate_2_condition as a2
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.tiny_animate import animate_2_modular_pipeline, animate_2_transformer_config

SIZE, SEGMENT = 32, 9   # 9 frames: 3 latent frames, so 5 carried frames span two of them


@pytest.fixture(scope="module")
def setup(tiny_model):
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate-2"))))
    pipe = animate_2_modular_pipeline(model, FlowMatchEulerDiscreteScheduler(shift=5.0))
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(1, 3, SIZE, SIZE, generator=generator) * 2 - 1
    driving = torch.rand(1, 3, 2 * SEGMENT, SIZE, SIZE, generator=generator) * 2 - 1
    image_block = WanAnimate2ImageVaeEncoderStep().init_pipeline()
    image_block.update_components(vae=model.vae)
    expected_image = image_block(image_pixels=image, output="reference_image_latents")
    return model, pipe, image, driving, expected_image


def _exact(ours, theirs):
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@torch.no_grad()
def test_driving_condition_and_reference_image_equal_the_pipeline(setup):
    model, pipe, image, driving, expected_image = setup
    image_latents = a2.reference_image_latents(model.vae, image)
    _exact(image_latents[0], expected_image)
    state = BlockState(driving_video_pixels=driving, reference_image_latents=expected_image, effective_segment=4,
                       segment_frame_length=SEGMENT)
    WanAnimate2SegmentVaeEncoderStep()(pipe, state, 1)   # the second segment starts at frame 4
    latents, condition = a2.driving_condition(model.vae, driving[:, :, 4:4 + SEGMENT])
    _exact(latents, state.driving_video_latents)
    _exact(condition[0], state.driving_video_condition)
    assert condition.shape == (1, 20, 3, SIZE // 8, SIZE // 8) and bool((condition[:, :4] == 1).all())


@pytest.mark.parametrize("carried", [0, 1, 5])
@torch.no_grad()
def test_reference_latents_equal_the_pipeline(setup, carried):
    model, pipe, image, driving, expected_image = setup
    # the previous segment's decoded frames (their size differs from the segment's: resized bicubic)
    out_frames = driving[:, :, :SEGMENT, :24, :40]
    state = BlockState(reference_image_latents=expected_image, segment_frame_length=SEGMENT,
                       prev_segment_conditioning_frames=max(carried, 1), out_frames=out_frames)
    WanAnimate2SegmentPrevFramesStep()(pipe, state, 1 if carried else 0)
    ours = a2.reference_latents(model.vae, a2.reference_image_latents(model.vae, image), SEGMENT,
                                out_frames[:, :, SEGMENT - carried:] if carried else None)
    _exact(ours[0], state.reference_latents)
    assert ours.shape == (1, 20, 4, SIZE // 8, SIZE // 8)
    # the mask marks the reference frame and the latent frames the carried pixel frames fall in (frame 0 alone, then 4)
    marked = {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 5: [1, 1, 1, 0]}[carried]
    assert ours[0, :4].amin(dim=(0, 2, 3)).tolist() == ours[0, :4].amax(dim=(0, 2, 3)).tolist() == marked


@torch.no_grad()
def test_extract_and_cached_passes_equal_the_pipeline(setup):
    model, _, image, driving, expected_image = setup
    # 10 blocks (the tiny model has 2): the unconditional branch skips block 9, which must exist to be skipped
    torch.manual_seed(3)
    transformer = WanAnimate2Transformer3DModel(**dict(animate_2_transformer_config(), num_layers=10)).eval()
    model = copy.copy(model)
    model.transformer = transformer
    pipe = animate_2_modular_pipeline(model, FlowMatchEulerDiscreteScheduler(shift=5.0))
    generator = torch.Generator().manual_seed(1)
    text = transformer.config.text_dim
    prompt_ref, prompt, negative = (torch.randn(1, 512, text, generator=generator) for _ in range(3))
    geometry = a2.segment_geometry(SEGMENT, SIZE, SIZE)
    driving_clip = a2.clip_tokens(model.image_encoder, driving[0, :, 0])
    image_clip = a2.clip_tokens(model.image_encoder, image[0])
    latents, condition = a2.driving_condition(model.vae, driving[:, :, :SEGMENT])
    reference = a2.reference_latents(model.vae, expected_image[None], SEGMENT)
    pipe.scheduler.set_timesteps(1)
    state = BlockState(driving_video_latents=latents, driving_video_condition=condition[0],
                       condition_clip_context=driving_clip, prompt_ref_embeds=prompt_ref,
                       kv_cache=a2.WanAnimate2KVCache(10), timesteps=pipe.scheduler.timesteps,
                       max_seq_len_ref=geometry.seq_len_ref, grid_sizes_ref=geometry.grid_sizes_ref)
    WanAnimate2RefExtractStep()(pipe, state, 0)
    cache = a2.extract_pass(model.transformer, latents, condition, prompt_ref, driving_clip, geometry)
    for layer in range(10):
        for ours, theirs in zip(cache.get(layer).get(), state.kv_cache.get(layer).get()):
            _exact(ours, theirs)
    noise = torch.randn(16, 4, SIZE // 8, SIZE // 8, generator=generator)
    state.__dict__.update(latents=noise, reference_latents=reference[0], num_inference_steps=1, num_segments=1,
                 max_seq_len=geometry.seq_len, segment_frame_length=SEGMENT, height=SIZE, width=SIZE,
                 generator=None, prompt_embeds=prompt, negative_prompt_embeds=negative,
                 denoiser_input_fields={"encoder_hidden_states_image": image_clip})
    WanAnimate2SegmentDenoiseInner()(pipe, state, 0)   # its guider: classifier-free guidance at 3.0
    t = pipe.scheduler.timesteps[0]
    conditional, unconditional = (a2.cached_pass(model.transformer, noise[None], reference, embeds, image_clip,
                                                 cache, t[None], geometry, unconditional=branch)
                                  for embeds, branch in ((prompt, False), (negative, True)))
    skipping = a2.cached_pass(transformer, noise[None], reference, negative, image_clip, cache, t[None], geometry)
    assert not torch.allclose(unconditional, skipping)   # the flag matters: block 9 is skipped
    prediction = unconditional + 3.0 * (conditional - unconditional)
    sigma = pipe.scheduler.sigmas[0]   # one Euler step from sigma to 0
    _exact(noise[None] - sigma * prediction, state.latents[None])


@torch.no_grad()
def test_a_batch_of_two_equals_each_sample_alone(setup):
    model, _, _, _, _ = setup
    transformer, geometry = model.transformer, a2.segment_geometry(5, SIZE, SIZE)
    generator = torch.Generator().manual_seed(2)
    h = SIZE // 8
    latents = torch.randn(2, 16, 2, h, h, generator=generator)
    condition = torch.cat([torch.ones(2, 4, 2, h, h), latents], dim=1)
    prompt_ref, prompt = (torch.randn(2, 512, transformer.config.text_dim, generator=generator) for _ in range(2))
    clip = torch.randn(2, 257, 1280, generator=generator)
    noisy, reference = torch.randn(2, 16, 3, h, h, generator=generator), torch.randn(2, 20, 3, h, h,
                                                                                      generator=generator)
    timestep = torch.tensor([700.0, 300.0])
    cache = a2.extract_pass(transformer, latents, condition, prompt_ref, clip, geometry)
    together = a2.cached_pass(transformer, noisy, reference, prompt, clip, cache, timestep, geometry)
    for i in range(2):
        one = slice(i, i + 1)
        alone_cache = a2.extract_pass(transformer, latents[one], condition[one], prompt_ref[one], clip[one], geometry)
        alone = a2.cached_pass(transformer, noisy[one], reference[one], prompt[one], clip[one], alone_cache,
                               timestep[one], geometry)
        torch.testing.assert_close(together[one], alone, rtol=0, atol=1e-5)
