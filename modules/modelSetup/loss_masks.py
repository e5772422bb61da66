"""The per-latent loss weights that masks and conditioned frames add (docs/masks.md)."""
import torch
from torch import Tensor

from modules.util.enum.WanVariant import WanVariant


def mask_loss_weights(batch: dict, loss_config, variant: WanVariant, latent_shape: tuple,
                      device: torch.device) -> Tensor | None:
    """(B, 1, T, h, w) weights, or None when nothing is weighted: the clip's mask ('mask_weight', 1 = learn) to the
    power `loss.mask_gamma`, raised to at least `loss.mask_min_weight`, times 0 on the latent frames a given image conditions when
    `loss.skip_conditioned_frames` (the first; the last too for FLF2V) of image-conditioned batches."""
    weights = None
    mask = batch.get("mask_weight")
    if mask is not None:
        floor = loss_config.mask_min_weight
        mask = mask.to(device, torch.float32, non_blocking=True)
        if loss_config.mask_gamma != 1:
            mask = mask ** loss_config.mask_gamma
        weights = floor + (1 - floor) * mask
    if loss_config.skip_conditioned_frames and "condition" in batch:
        frames = torch.ones(1, 1, latent_shape[2], 1, 1, device=device)
        frames[:, :, 0] = 0
        if variant is WanVariant.FLF2V:
            frames[:, :, -1] = 0
        weights = frames if weights is None else weights * frames
    return weights
