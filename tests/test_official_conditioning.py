"""Conditions read from files as the official Wan code reads them, in training and sampling alike.

VACE: a mask file keeps its grey values in the 64 mask channels (its first, red, channel mapped to [0, 1]); only the
split of the control into kept and generated parts thresholds it at 0.5; without a control video the mask is all
ones. Animate: the reference image is fitted into the video's size with OpenCV's INTER_LINEAR between black bars;
CLIP sees that fitted reference squashed to its size (torch bicubic); the replace mask is its red channel / 255.

The official functions are transcribed below (their arithmetic only) as the reference:
- Wan-Video/Wan2.1 at 9737cba9c1c3c4d04b33fcad41c111989865d315: wan/vace.py (WanVace.prepare_source,
  vace_encode_frames, vace_encode_masks, vace_latent), wan/utils/vace_processor.py (VaceVideoProcessor.resize_crop);
- Wan-Video/Wan2.2 at 42bf4cfaa384bc21833865abc2f9e6c0e67233dc: wan/animate.py (WanAnimate.padding_resize, the
  reference's `refer_images / 127.5 - 1` in generate, the `clip.visual` call on it, prepare_source_for_replace's
  mask), wan/modules/animate/clip.py (CLIPModel.visual's preprocessing, use_31_block).
"""
import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.model import animate_condition as ac
from modules.model.vace_condition import mask_from_frames, model_encoder, vace_context
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.modelSampler.vace_sampling import load_vace_inputs, sample_context
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.video_frames import write_video
from tests.test_animate_data import _loader as animate_loader
from tests.test_vace_data import _loader as vace_loader

FRAMES, SIZE = 9, 32


# --- the official code, transcribed ---------------------------------------------------------------------------

def official_mask(frames: np.ndarray) -> torch.Tensor:
    """prepare_source's mask from decord's uint8 (T, H, W, C) frames of the video's size (resize_crop resizes
    nothing then): normalised to [-1, 1] as every video, then its first channel clamp((m + 1) / 2)."""
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)
    video = video.transpose(0, 1).float().div_(127.5).sub_(1.)
    return torch.clamp((video[:1, :, :, :] + 1) / 2, min=0, max=1)


def official_encode_frames(encode, frames, mask):
    """vace_encode_frames of one clip without references; `encode` is the VAE (normalised latents)."""
    mask = torch.where(mask > 0.5, 1.0, 0.0)
    inactive = encode((frames * (1 - mask) + 0 * mask)[None])[0]
    reactive = encode((frames * mask + 0 * (1 - mask))[None])[0]
    return torch.cat((inactive, reactive), dim=0)


def official_encode_masks(mask, vae_stride=(4, 8, 8)):
    """vace_encode_masks of one clip without references."""
    c, depth, height, width = mask.shape
    new_depth = int((depth + 3) // vae_stride[0])
    height = 2 * (int(height) // (vae_stride[1] * 2))
    width = 2 * (int(width) // (vae_stride[2] * 2))
    mask = mask[0, :, :, :]
    mask = mask.view(depth, height, vae_stride[1], width, vae_stride[1])
    mask = mask.permute(2, 4, 0, 1, 3)
    mask = mask.reshape(vae_stride[1] * vae_stride[2], depth, height, width)
    return F.interpolate(mask.unsqueeze(0), size=(new_depth, height, width), mode='nearest-exact').squeeze(0)


def official_context(encode, video, mask, num_frames, height, width):
    """prepare_source (a video without a mask, or no video at all: an all-ones mask), then vace_latent."""
    if video is None:
        video = torch.zeros((3, num_frames, height, width))
        mask = torch.ones_like(video)
    elif mask is None:
        mask = torch.ones_like(video)
    return torch.cat([official_encode_frames(encode, video, mask), official_encode_masks(mask)], dim=0)


def official_padding_resize(img_ori, height=512, width=512, padding_color=(0, 0, 0), interpolation=cv2.INTER_LINEAR):
    ori_height = img_ori.shape[0]
    ori_width = img_ori.shape[1]
    channel = img_ori.shape[2]
    img_pad = np.zeros((height, width, channel))
    img_pad[:, :, 0] = padding_color[0]
    img_pad[:, :, 1] = padding_color[1]
    img_pad[:, :, 2] = padding_color[2]
    if (ori_height / ori_width) > (height / width):
        new_width = int(height / ori_height * ori_width)
        img = cv2.resize(img_ori, (new_width, height), interpolation=interpolation)
        padding = int((width - new_width) / 2)
        img_pad[:, padding: padding + new_width, :] = img
    else:
        new_height = int(width / ori_width * ori_height)
        img = cv2.resize(img_ori, (width, new_height), interpolation=interpolation)
        padding = int((height - new_height) / 2)
        img_pad[padding: padding + new_height, :, :] = img
    return np.uint8(img_pad)


def official_replace_mask(mask_images: np.ndarray) -> np.ndarray:
    """prepare_source_for_replace's mask from decord's uint8 (T, H, W, C) frames."""
    return mask_images[:, :, :, 0] / 255


def official_reference_pixels(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """generate's refer_pixel_values (1, 3, H, W) of the padding_resize'd reference."""
    return torch.tensor(official_padding_resize(image, height, width) / 127.5 - 1).permute(2, 0, 1)[None].float()


def official_clip_tokens(image_encoder, image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """generate's clip_context: clip.visual([refer_pixel_values[0, :, None]]): bicubic to the encoder's size,
    x * 0.5 + 0.5, Normalize(CLIP mean, std), then the first 31 of 32 blocks (hidden_states[-2] of HF's CLIP)."""
    img = official_reference_pixels(image, height, width)[0]
    size = (image_encoder.config.image_size,) * 2
    videos = F.interpolate(img[:, None].transpose(0, 1), size=size, mode="bicubic", align_corners=False)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    videos = (videos.mul_(0.5).add_(0.5) - mean) / std
    return image_encoder(pixel_values=videos, output_hidden_states=True).hidden_states[-2]


# --- inputs ---------------------------------------------------------------------------------------------------

def _grey_and_coloured_mask() -> np.ndarray:
    """One mask image (SIZE x SIZE x 3): a soft edge (a ramp 0..255), the greys 0.3 and 0.7, and coloured cells whose
    red channel says the opposite of their mean."""
    mask = np.zeros((SIZE, SIZE, 3), np.uint8)
    mask[:8] = np.linspace(0, 255, SIZE).round().astype(np.uint8)[None, :, None]   # soft edge
    mask[8:16, :16] = 77                  # 0.30
    mask[8:16, 16:] = 178                 # 0.70
    mask[16:24, :16] = (200, 30, 90)      # red 0.78, mean 0.42
    mask[16:24, 16:] = (60, 220, 220)     # red 0.24, mean 0.65
    mask[24:, :] = (255, 255, 255)
    return mask


def _blocky(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (FRAMES, SIZE // 8, SIZE // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)


@pytest.fixture(scope="module")
def vace(tiny_model):
    return tiny_model("wan2.1-vace"), WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model(
        "wan2.1-vace"))))


@pytest.fixture(scope="module")
def vace_clip(tmp_path_factory):
    """A training clip with its control (lossless PNG frames) and its grey / coloured mask image."""
    folder = tmp_path_factory.mktemp("vace") / "data"
    folder.mkdir()
    write_video(folder / "clip.mp4", _blocky(0), 16)
    (folder / "clip.txt").write_text("a red square\n")
    (folder / "clip_control").mkdir()
    for index, frame in enumerate(_blocky(1)):
        Image.fromarray(frame).save(folder / "clip_control" / f"{index:03d}.png")
    Image.fromarray(_grey_and_coloured_mask()).save(folder / "clip_mask.png")
    return folder


# --- VACE -----------------------------------------------------------------------------------------------------

def test_a_mask_keeps_its_grey_values_and_reads_its_red_channel():
    frames = np.repeat(_grey_and_coloured_mask()[None], FRAMES, axis=0)
    ours = mask_from_frames(frames)
    torch.testing.assert_close(ours, official_mask(frames), rtol=0, atol=1e-7)
    assert len(torch.unique(ours)) > 30                                   # the ramp's greys survive
    assert torch.allclose(ours[0, 0, 8:16, :16], torch.tensor(77 / 255))  # a 0.3 grey is no 0
    assert torch.allclose(ours[0, 0, 16:24, 16:], torch.tensor(60 / 255))  # the red channel, not the mean


def test_training_and_sampling_build_the_official_context_from_the_same_files(vace, vace_clip, tmp_path):
    folder, model = vace
    loader = vace_loader(tmp_path, vace_clip, folder)   # 9 frames of 32 x 32: the clip's own size
    loader.attach_model(model, torch.device("cpu"))
    loader.cache()
    trained = next(loader.batches(0))["vace_context"][0]

    sample = SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=FRAMES,
                          control_video=str(vace_clip / "clip_control"), mask_video=str(vace_clip / "clip_mask.png"))
    sampled, references = sample_context(model, sample)

    control = torch.from_numpy(_blocky(1)).permute(3, 0, 1, 2).float() / 127.5 - 1
    mask = official_mask(np.repeat(_grey_and_coloured_mask()[None], FRAMES, axis=0))
    with torch.no_grad():
        expected = official_context(model_encoder(model), control, mask, FRAMES, SIZE, SIZE)
    assert references == 0 and trained.shape == sampled.shape == expected.shape == (96, 3, SIZE // 8, SIZE // 8)
    torch.testing.assert_close(trained[32:], sampled[32:], rtol=0, atol=0)   # one mask reading
    torch.testing.assert_close(sampled, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(trained, expected, rtol=0, atol=1e-6)
    _, read, _ = load_vace_inputs(str(vace_clip / "clip_control"), str(vace_clip / "clip_mask.png"), [], FRAMES,
                                  SIZE, SIZE)
    torch.testing.assert_close(read, mask, rtol=0, atol=0)


def test_without_a_control_video_the_mask_is_all_ones(vace):
    _, model = vace
    grey = mask_from_frames(np.repeat(_grey_and_coloured_mask()[None], FRAMES, axis=0))
    with torch.no_grad():
        ours = vace_context(model_encoder(model), None, grey, num_frames=FRAMES, height=SIZE, width=SIZE)
        expected = official_context(model_encoder(model), None, grey, FRAMES, SIZE, SIZE)
    assert torch.all(ours[32:] == 1)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_a_sample_mask_without_a_control_video_is_noted_as_ignored(vace, vace_clip):
    _, model = vace
    sampler = WanModelSampler(model, device="cpu")
    _, notes = sampler.resolve(SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=FRAMES,
                                            mask_video=str(vace_clip / "clip_mask.png")), log=False)
    assert any(note.startswith("mask_video ignored: without a control video") for note in notes)
    _, notes = sampler.resolve(SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=FRAMES,
                                            control_video=str(vace_clip / "clip_control"),
                                            mask_video=str(vace_clip / "clip_mask.png")), log=False)
    assert notes == []


# --- Animate --------------------------------------------------------------------------------------------------

REFERENCE_SIZES = {"taller": (50, 20), "wider": (18, 44), "smaller": (12, 20), "larger, same aspect": (48, 72),
                   "the target's size": (32, 48)}


@pytest.mark.parametrize("shape", REFERENCE_SIZES.values(), ids=REFERENCE_SIZES.keys())
def test_the_animate_reference_is_fitted_as_padding_resize(shape):
    image = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    expected = official_reference_pixels(image, 32, 48)
    torch.testing.assert_close(ac.reference_pixels(Image.fromarray(image), 32, 48), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ac.reference_pixels(image, 32, 48), expected, rtol=0, atol=1e-6)


def test_the_animate_sampler_reads_a_replace_mask_as_the_official_code_and_training_do():
    frames = np.repeat(_grey_and_coloured_mask()[None], 3, axis=0)
    ours = ac.mask_pixels([Image.fromarray(frame) for frame in frames], SIZE, SIZE)
    expected = torch.from_numpy(official_replace_mask(frames)).float()[None, None]   # (1, 1, F, H, W)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)
    # the data loader's reading (EncodeAnimate.companion_pixels), of frames of the clip's size
    torch.testing.assert_close(ours[0, 0], torch.from_numpy(frames[..., 0].astype(np.float32) / 255.0), rtol=0, atol=0)


@pytest.fixture(scope="module")
def animate(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate"))))


def _animate_set(folder, reference: np.ndarray):
    """One Animate training clip (5 frames of 32 x 32 as the loader cuts it) with its pose, face and `reference`."""
    from modules.util.demo_animate import animate_clip

    parts = animate_clip((220, 40, 40), "left", 9, SIZE)
    folder.mkdir()
    for suffix, frames in (("", parts["clip"]), ("_pose", parts["pose"]), ("_face", parts["face"])):
        write_video(folder / f"c{suffix}.mp4", frames, 30)
    Image.fromarray(reference).save(folder / "c_ref.png")
    (folder / "c.txt").write_text("a person")


def _training_and_sampling_inputs(animate, folder, cache, item_name: str, transformer_input) -> tuple:
    """What training's item holds under `item_name`, and what the sampler's first transformer call receives
    (`transformer_input` of its keyword arguments), for the set in `folder`."""
    loader = animate_loader(folder, cache=cache)
    loader.attach_model(animate, torch.device("cpu"))
    items = Pipeline(loader._item_modules() + list(loader.encoders.values()), loader.config.seed,
                     outputs=[item_name])
    items.start_epoch(0)
    seen = []
    handle = animate.transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(transformer_input(kwargs).clone()), with_kwargs=True)
    try:
        WanModelSampler(animate, device="cpu").sample(SampleConfig(
            prompt="a person", width=SIZE, height=SIZE, frames=5, steps=1, guidance=1.0, seed=1,
            reference_image=str(folder / "c_ref.png"), pose_video=str(folder / "c_pose.mp4"),
            face_video=str(folder / "c_face.mp4"), continuation_frames=1))
    finally:
        handle.remove()
    return items.get_item(0)[item_name], seen[0][0].float()


def test_animate_training_and_sampling_encode_the_official_reference(animate, tmp_path):
    """A reference of another aspect than the clip's: the training item's reference frame and the sampler's are the
    latents of the official padding_resize."""
    reference = np.random.default_rng(3).integers(0, 256, (40, 24, 3), dtype=np.uint8)   # taller than the clip
    _animate_set(tmp_path / "set", reference)
    with torch.no_grad():
        expected = ac.reference_image_latents(animate.vae, official_reference_pixels(reference, SIZE, SIZE))[0]
    trained, sampled = _training_and_sampling_inputs(animate, tmp_path / "set", tmp_path / "cache", "condition",
                                                     lambda kwargs: kwargs["hidden_states"][:, 16:, :1])
    torch.testing.assert_close(trained[:, :1], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(sampled, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(50, 20), (18, 44)], ids=["taller", "wider"])
def test_animate_training_and_sampling_give_clip_the_official_reference(animate, tmp_path, shape):
    """CLIP's tokens of a reference not of the clip's aspect: the training item's and the sampler's equal the official
    clip.visual of the fitted reference (diffusers' pipeline crops the original image instead)."""
    reference = np.random.default_rng(5).integers(0, 256, (*shape, 3), dtype=np.uint8)
    _animate_set(tmp_path / "set", reference)
    with torch.no_grad():
        expected = official_clip_tokens(animate.image_encoder, reference, SIZE, SIZE)[0]
    trained, sampled = _training_and_sampling_inputs(animate, tmp_path / "set", tmp_path / "cache", "image_embeds",
                                                     lambda kwargs: kwargs["encoder_hidden_states_image"])
    torch.testing.assert_close(trained, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(sampled, expected, rtol=0, atol=1e-5)
