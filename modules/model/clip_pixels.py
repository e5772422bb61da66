"""CLIP image tokens as the official Wan code makes them, for every pathway that feeds CLIP (I2V, FLF2V, Fun, E2V
elements, Animate's reference).

The official `CLIPModel.visual` (Wan-Video/Wan2.1 wan/modules/clip.py; the same in Wan2.2 wan/modules/animate/clip.py
and VideoX-Fun's Wan pipelines) takes the image in [-1, 1], squashes it to the encoder's square size with torch's
bicubic interpolation (no crop, no antialiasing), maps it to [0, 1] and normalises with CLIP's mean and std; the
tokens are hidden_states[-2] (`use_31_block`). diffusers' `CLIPImageProcessor` (and ComfyUI's default "center" crop)
resize the shortest side and crop the centre instead, which drops the sides of every non-square image: training on
those tokens would teach the model other tokens than the official sampler gives it."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# Part of every cache key that holds CLIP tokens: tokens cached through diffusers' crop are not reused.
CLIP_PREPROCESS = "official-squash"

# CLIP ViT-H/14's normalisation, as the official CLIPModel's transforms apply it
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_pixels(image) -> Tensor:
    """A PIL image or a uint8 (H, W, 3) array -> (1, 3, H, W) float in [-1, 1] (the official `TF.to_tensor(img)
    .sub_(0.5).div_(0.5)`)."""
    array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    # (H, W, 3) uint8 -> (1, 3, H, W) in [-1, 1]
    return torch.from_numpy(np.array(array, dtype=np.uint8)).permute(2, 0, 1)[None].float().div(255).sub(0.5).div(0.5)


def official_clip_tokens(image_encoder, pixels: Tensor) -> Tensor:
    """(N, 3, H, W) in [-1, 1] -> (N, tokens, dim): hidden_states[-2] of each image squashed to the encoder's size."""
    size = image_encoder.config.image_size
    parameter = next(image_encoder.parameters())
    squashed = F.interpolate(pixels.float(), size=(size, size), mode="bicubic", align_corners=False)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    normalised = (squashed.mul(0.5).add(0.5) - mean) / std
    normalised = normalised.to(parameter.device, parameter.dtype)
    return image_encoder(pixel_values=normalised, output_hidden_states=True).hidden_states[-2]


def images_clip_tokens(image_encoder, images: list) -> Tensor:
    """PIL images or uint8 arrays of any sizes -> (N, tokens, dim), each squashed on its own."""
    return torch.cat([official_clip_tokens(image_encoder, image_pixels(image)) for image in images])
