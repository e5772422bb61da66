"""CLIP tokens for I2V, FLF2V and Fun as the official Wan code makes them, in training and sampling alike.

The official reference, transcribed (its arithmetic only) from Wan-Video/Wan2.1 at
9737cba9c1c3c4d04b33fcad41c111989865d315: wan/image2video.py (`img = TF.to_tensor(img).sub_(0.5).div_(0.5)`, then
`self.clip.visual([img[:, None, :, :]])`; first_last_frame2video.py passes both frames the same way) and
wan/modules/clip.py (`CLIPModel.visual`: bicubic F.interpolate of each (1, 3, H, W) image to the encoder's square size,
`mul_(0.5).add_(0.5)`, the transforms' Normalize with CLIP's mean and std, the 31st of 32 blocks = hidden_states[-2]).
diffusers' processor crops the centre of a non-square image instead: on the wide images below its tokens differ, so
each test here fails on the processor path."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from modules.dataLoader.DiskCache import DiskCache
from modules.dataLoader.pipeline.EncodeVideo import EncodeVideo
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.video_frames import frames_to_tensor

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def official_visual(image_encoder, images: list[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) images -> (N, tokens, dim) as image2video.py and CLIPModel.visual compute them."""
    size = (image_encoder.config.image_size,) * 2
    videos = []
    for image in images:
        img = torch.from_numpy(image.copy()).permute(2, 0, 1).float().div(255).sub_(0.5).div_(0.5)  # TF.to_tensor
        u = img[:, None, :, :]                                                                     # (3, 1, H, W)
        videos.append(F.interpolate(u.transpose(0, 1), size=size, mode="bicubic", align_corners=False))
    videos = torch.cat(videos).mul_(0.5).add_(0.5)
    videos = (videos - torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)) / torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    return image_encoder(pixel_values=videos, output_hidden_states=True).hidden_states[-2]


def _wide(seed: int, height: int = 24, width: int = 56) -> np.ndarray:
    """Blocky colours whose left and right thirds differ from the centre (what a centre crop drops)."""
    rng = np.random.default_rng(seed)
    blocks = (rng.random((height // 4, width // 4, 3)) * 255).astype(np.uint8)
    return np.repeat(np.repeat(blocks, 4, axis=0), 4, axis=1)


def _processor_tokens(model, images) -> torch.Tensor:
    pixels = model.image_processor(images=images, return_tensors="pt").pixel_values
    return model.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]


@pytest.fixture(scope="module")
def i2v(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-i2v"))))


def test_encode_image_squashes_a_wide_image_as_the_official_clip_visual(i2v):
    images = [_wide(0), _wide(1, 40, 16)]
    with torch.no_grad():
        ours = i2v.encode_image([Image.fromarray(images[0]), images[1]])
        official = official_visual(i2v.image_encoder, images)
        processor = _processor_tokens(i2v, images)
    torch.testing.assert_close(ours, official, atol=1e-5, rtol=0)
    assert (processor - official).abs().max() > 1e-2   # the crop would give other tokens


@pytest.mark.parametrize("condition", ["first", "first_last"])
def test_training_items_carry_the_official_tokens_of_a_wide_clip(i2v, tmp_path, condition):
    frames = np.stack([_wide(seed, 32, 64) for seed in range(5)])       # (T, H, W, 3)
    encode = EncodeVideo(i2v, DiskCache(tmp_path / "cache", "test"), identity="tiny", condition=condition, clip=True)
    with torch.no_grad():
        tokens = encode._encode(frames_to_tensor(frames))["image_embeds"]
        ends = [frames[0]] + ([frames[-1]] if condition == "first_last" else [])
        official = official_visual(i2v.image_encoder, ends)
    # (N, tokens, dim) -> (N*tokens, dim), as the item stores them
    torch.testing.assert_close(tokens, official.flatten(0, 1).float(), atol=1e-5, rtol=0)


def test_the_sampler_gives_the_transformer_the_official_tokens(i2v, tmp_path, monkeypatch):
    path = tmp_path / "first.png"
    Image.fromarray(_wide(3, 32, 64)).save(path)
    seen = []
    original = i2v.transformer.forward

    def forward(*args, **kwargs):
        seen.append(kwargs["encoder_hidden_states_image"].detach().clone())
        return original(*args, **kwargs)

    monkeypatch.setattr(i2v.transformer, "forward", forward)
    sample = SampleConfig(prompt="a square", image=str(path), width=64, height=32, frames=5, steps=1, guidance=1.0,
                          seed=1)
    WanModelSampler(i2v).sample(sample)
    loaded = np.asarray(WanModelSampler._load_image(str(path), 32, 64))
    with torch.no_grad():
        official = official_visual(i2v.image_encoder, [loaded])
    torch.testing.assert_close(seen[0][0].float(), official[0].float(), atol=1e-5, rtol=0)
