"""VACE's control context (modules/model/vace_condition.py) equals diffusers' `WanVACEPipeline` preparation in fp32:
control video, a mask with grey (unbinarised) values, references of another aspect fitted onto a white canvas. With
several references diffusers is given them reversed: it prepends each in turn, so its own order is the reverse of
the official code's (Wan-Video/Wan2.1 wan/vace.py vace_encode_frames: [ref0, ref1, video])."""
import numpy as np
import pytest
import torch
from PIL import Image

from modules.model.vace_condition import (fit_reference, fold_mask, image_to_tensor, model_encoder, vace_context)
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig

FRAMES, HEIGHT, WIDTH = 9, 32, 48


@pytest.fixture(scope="module")
def vace_model(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-vace"))))


def _frames(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (FRAMES, HEIGHT // 8, WIDTH // 8, 3)).astype(np.uint8)
    return base.repeat(8, axis=1).repeat(8, axis=2)   # blocky, so the tiny VAE sees structure


def _mask() -> np.ndarray:
    mask = np.zeros((FRAMES, HEIGHT, WIDTH), np.uint8)
    mask[:, 8:24, 16:40] = 255
    mask[3:6, :, :8] = 77   # grey: folded as it is, split as 0 (below 0.5)
    mask[6:, :, 40:] = 180  # grey above 0.5: split as 1
    return mask


def _references() -> list[Image.Image]:
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for size in ((24, 16, 3), (16, 40, 3))]


@pytest.mark.parametrize("with_mask,references", [(True, 2), (False, 0), (True, 1)])
def test_the_context_equals_diffusers_preparation(vace_model, with_mask, references):
    pipeline = vace_model.create_pipeline()
    frames, mask = _frames(0), _mask()
    refs = _references()[:references]
    video_pil = [Image.fromarray(frame) for frame in frames]
    mask_pil = [Image.fromarray(np.stack([m] * 3, axis=-1)) for m in mask] if with_mask else None
    video, masks, prepared = pipeline.preprocess_conditions(video_pil, mask_pil, list(reversed(refs)) or None, 1,
                                                            HEIGHT, WIDTH, FRAMES, torch.float32, "cpu")
    with torch.no_grad():
        theirs = torch.cat([pipeline.prepare_video_latents(video, masks, prepared, None, "cpu"),
                            pipeline.prepare_masks(masks, prepared)], dim=1)[0]
        ours = vace_context(model_encoder(vace_model),
                            torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1,
                            torch.from_numpy(mask)[None].float() / 255 if with_mask else None,
                            [image_to_tensor(image) for image in refs])
    assert ours.shape == (96, references + (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    if references == 2:   # the order matters: given in the official order, diffusers' context differs
        _, _, same_order = pipeline.preprocess_conditions(video_pil, mask_pil, refs, 1, HEIGHT, WIDTH, FRAMES,
                                                          torch.float32, "cpu")
        with torch.no_grad():
            unreversed = pipeline.prepare_video_latents(video, masks, same_order, None, "cpu")[0]
        assert (unreversed[:, :2] - ours[:32, :2]).abs().max() > 0.1


def test_references_fit_inside_a_white_canvas_and_the_mask_folds_8x8():
    tall = torch.full((3, 16, 8), -1.0)           # black, half as wide as tall
    fitted = fit_reference(tall, 8, 16)           # into a wide canvas: 8 x 4 in the middle
    assert fitted.shape == (3, 8, 16)
    assert torch.all(fitted[:, :, 6:10] == -1) and torch.all(fitted[:, :, :6] == 1) and torch.all(fitted[:, :, 10:] == 1)
    assert fit_reference(tall, 16, 8) is tall     # the video's size: used as it is
    mask = torch.zeros(1, 5, 16, 16)
    mask[0, :, 3, 10] = 1                         # one pixel: latent cell (0, 1), channel 3 * 8 + 2
    folded = fold_mask(mask, reference_count=1)
    assert folded.shape == (64, 1 + 2, 2, 2)
    assert torch.all(folded[:, 0] == 0)           # the reference frame
    assert folded.sum() == 2 and torch.all(folded[26, 1:, 0, 1] == 1)
