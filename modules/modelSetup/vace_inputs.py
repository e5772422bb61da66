"""A VACE model's training forward: the control context and the reference frames (DESIGN.md section 11).

The batch's `vace_context` (B, 96, n + T, h, w) holds, in its first n latent frames, the references' latents
(channels 0-15, normalised). As in the official inference (wan/vace.py: the noise spans the reference frames too,
which are cut from the result), the model input is the noised [references, video] latents; the prediction of the
reference frames is cut before the loss, so the loss, its masks and the x0 estimate concern the video alone. The
references' noise is drawn from each item's generator after the video's, so the video's noise is the one a plain
model would draw.
"""
import torch
from torch import Tensor


def with_references(context: Tensor, noisy: Tensor, sigmas: Tensor, item_generators: list[torch.Generator],
                    device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(model input (B, z, n + T, h, w), the context on the device, n)."""
    context = context.to(device, torch.float32, non_blocking=True)
    references = context.shape[2] - noisy.shape[2]
    if references <= 0:
        return noisy, context, 0
    clean = context[:, :noisy.shape[1], :references]   # (B, z, n, h, w): the references' normalised latents
    noise = torch.cat([torch.randn(clean[i:i + 1].shape, generator=g).to(device)
                       for i, g in enumerate(item_generators)])
    s = sigmas.view(-1, 1, 1, 1, 1)
    return torch.cat([(1 - s) * clean + s * noise, noisy], dim=2), context, references


def control_kwargs(transformer, context: Tensor) -> dict:
    """The VACE forward arguments: the context, at the official full strength (vace_context_scale 1)."""
    scale = torch.ones(len(transformer.config.vace_layers), device=context.device, dtype=context.dtype)
    return {"control_hidden_states": context, "control_hidden_states_scale": scale}
