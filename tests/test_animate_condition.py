"""Our Animate conditions (modules/model/animate_condition.py) equal what diffusers' WanAnimatePipeline passes to its
transformer, to 1e-6 in fp32: animate and replace modes, the reference latent and its CLIP tokens, pose latents, face
pixels, and the continuation frames of a later segment (1 or 5). The reference image has the video's size: of another
size, the pipeline resizes it with PIL, the official code (followed here) with OpenCV. The pipeline's CLIP tokens are
the official ones (official_clip below): its own encode_image crops the original image where the official code
squashes the fitted reference (tests/test_official_conditioning.py checks ours against the official code)."""
import numpy as np
import pytest
import torch
from diffusers import WanAnimatePipeline
from PIL import Image

from modules.model import animate_condition as ac

SIZE, FRAMES = 32, 5   # 32 x 32 pixels (4 x 4 latents), one segment of 5 frames (2 latent frames)


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return WanAnimatePipeline.from_pretrained(tiny_model("wan2.2-animate"), torch_dtype=torch.float32)


def _frames(seed: int, count: int, size: int, grey: bool = False) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    if grey:
        return [Image.fromarray((rng.random((size, size)) > 0.5).astype(np.uint8) * 255, "L").convert("RGB")
                for _ in range(count)]
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def official_clip(pipe):
    """The pipeline's encode_image made to give CLIP what the official code gives it (the fitted reference, squashed
    to the encoder's size): without it the pipeline's tokens differ from the official ones for any image."""
    return lambda image, device=None: ac.clip_image_tokens(pipe.image_encoder, ac.reference_pixels(image, SIZE, SIZE))


def _captured(pipe, **inputs) -> dict:
    seen = {}

    def hook(_module, _args, kwargs):
        if not seen:
            seen.update({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    pipe.encode_image = official_clip(pipe)
    try:
        pipe(prompt="a person", height=SIZE, width=SIZE, segment_frame_length=FRAMES, num_inference_steps=1,
             guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0), **inputs)
    finally:
        handle.remove()
        del pipe.encode_image
    return seen


@pytest.mark.parametrize("mode", ["animate", "replace"])
def test_condition_equals_the_pipeline_transformer_inputs(pipe, mode):
    # the video's size: the pipeline fits a reference of another size with PIL's bilinear filter, the official code
    # (which ours follows: test_official_conditioning.py) with OpenCV's INTER_LINEAR; at the video's size neither
    # resizes, so the two agree and every other condition is compared here
    reference = _frames(1, 1, SIZE)[0]
    pose, face = _frames(2, FRAMES, SIZE), _frames(3, FRAMES, 16)
    extra = dict(background_video=_frames(4, FRAMES, SIZE), mask_video=_frames(5, FRAMES, SIZE, grey=True)) \
        if mode == "replace" else {}
    seen = _captured(pipe, image=reference, pose_video=pose, face_video=face, mode=mode,
                     prev_segment_conditioning_frames=1, **extra)
    with torch.no_grad():
        condition = ac.build_condition(
            pipe.vae, ac.reference_pixels(reference, SIZE, SIZE), ac.video_pixels(pose, SIZE, SIZE),
            ac.video_pixels(face, 16, 16), continuation_frames=1, mode=mode,
            background=ac.video_pixels(extra["background_video"], SIZE, SIZE) if extra else None,
            mask=ac.mask_pixels(extra["mask_video"], SIZE, SIZE) if extra else None,
            image_embeds=ac.clip_image_tokens(pipe.image_encoder, ac.reference_pixels(reference, SIZE, SIZE)))
    close = dict(rtol=0, atol=1e-6)
    # the reference's pixels are x / 127.5 - 1 in float64 as the official code maps them, the pipeline's
    # 2 * (x / 255) - 1 in float32: one float32 step apart, a few 1e-6 in the latents
    torch.testing.assert_close(condition.reference_latents, seen["hidden_states"][:, 16:], rtol=0, atol=1e-5)
    torch.testing.assert_close(condition.pose_latents, seen["pose_hidden_states"], **close)
    torch.testing.assert_close(condition.face_pixels, seen["face_pixel_values"], **close)
    torch.testing.assert_close(condition.image_embeds, seen["encoder_hidden_states_image"], **close)
    if mode == "replace":   # the character mask reaches the condition: 0 where the character is
        assert condition.reference_latents[:, :4, 1:].min() == 0


@pytest.mark.parametrize("continuation", ac.CONTINUATION_FRAMES)
@pytest.mark.parametrize("mode", ["animate", "replace"])
def test_continuation_segment_equals_the_pipeline(pipe, mode, continuation):
    frames = 9   # a segment long enough for 5 continuation frames
    generator = torch.Generator().manual_seed(continuation)
    previous = torch.rand(1, 3, continuation, 24, 24, generator=generator) * 2 - 1   # resized as the pipeline does
    background = torch.rand(1, 3, frames, SIZE, SIZE, generator=generator) * 2 - 1 if mode == "replace" else None
    mask = (torch.rand(1, 1, frames, SIZE, SIZE, generator=generator) > 0.5).float() if mode == "replace" else None
    with torch.no_grad():
        expected = pipe.prepare_prev_segment_cond_latents(
            previous, background_video=background, mask_video=mask, batch_size=1, segment_frame_length=frames,
            start_frame=frames - continuation, height=SIZE, width=SIZE, prev_segment_cond_frames=continuation,
            task=mode, device="cpu")
        ours = ac.segment_condition_latents(pipe.vae, frames, SIZE, SIZE, continuation, mode, previous, background,
                                            mask, continuing=True)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    # the continuation frames are marked in the mask (animate: exactly the latent frames they occupy)
    if mode == "animate":
        marked = ours[:, :4].amax(dim=(0, 1, 3, 4))
        assert marked.tolist() == [1.0 if i < ac.condition_latent_frames(continuation, True) - 1 else 0.0
                                   for i in range(marked.numel())]


def test_long_clip_segments_and_padding_as_the_pipeline(pipe):
    for frames, segment, continuation in ((77, 77, 1), (100, 77, 1), (100, 77, 5), (13, 5, 1)):
        padded, count = ac.segment_plan(frames, segment, continuation)
        assert (padded - continuation) % (segment - continuation) == 0 and padded >= frames
        assert padded < frames + segment - continuation
        assert count == padded // (segment - continuation)
    assert ac.pad_frames(list(range(1, 6)), 10) == pipe.pad_video_frames(list(range(1, 6)), 10) \
        == [1, 2, 3, 4, 5, 4, 3, 2, 1, 2]
