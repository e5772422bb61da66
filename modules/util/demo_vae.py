"""The demo's VAE, set by hand: diffusers' `AutoencoderKLWan` (the tiny Wan 2.1 config) whose weights make it encode
each 8 x 8 pixel cell of each frame as its average colour, and decode a latent back to those cells.

A random tiny VAE decodes every latent to noise, and training one to reconstruct even the squares takes far longer
than a demo may (measured: no progress past the flat-grey average in 300 steps, about 0.8 s a step on 2 shared
cores). Every layer of the Wan VAE can pass a signal on linearly instead: residual and attention branches add
nothing, the shortcuts and resampling convolutions copy or average channels, and the causal time convolutions move
the four frames of a chunk into (encoder) and out of (decoder) four channel groups; the RMS-normalised heads stay
linear to about 1 % because a large constant channel dominates their norm. So the latent of a chunk is the 4 frames'
cell colours (12 of the 16 channels), and the decoded video is the input averaged over 8 x 8 cells: a square is
seen in its colour and place, moving frame by frame, a little blocky.
"""
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import (WanAttentionBlock, WanResample, WanResidualBlock)

K = 30.0          # the constant channel: keeps the RMS norms of the heads (nearly) linear
GAMMA = 0.1       # small head activations: SiLU(y) ~ y / 2
RGB, CONST = [0, 1, 2], 3
GROUPS = [[0, 1, 2], [4, 5, 6], [8, 9, 10], [12, 13, 14]]   # frame k of a chunk, where channels run 4 wide


def _copy(weight, out_channels, in_channels, tap):
    for o, i in zip(out_channels, in_channels):
        weight[(o, i) + tap] = 1.0


@torch.no_grad()
def set_cell_average_weights(vae) -> None:
    """Sets every weight of a Wan 2.1-layout `AutoencoderKLWan` (3 channels, stride 4 x 8 x 8, z_dim >= 12)."""
    for p in vae.parameters():
        p.zero_()
    enc, dec = vae.encoder, vae.decoder
    # residual branches and attention add nothing: every block passes its input on (shortcuts embed channels)
    for module in vae.modules():
        if isinstance(module, WanResidualBlock):
            for norm in (module.norm1, module.norm2):
                norm.gamma.fill_(1.0)
            if not isinstance(module.conv_shortcut, torch.nn.Identity):
                n = min(module.conv_shortcut.weight.shape[:2])
                _copy(module.conv_shortcut.weight, range(n), range(n), (0, 0, 0))
        if isinstance(module, WanAttentionBlock):
            module.norm.gamma.fill_(1.0)
    current = (2, 1, 1)   # the causal 3x3x3 conv's tap on the current frame, centre pixel
    _copy(enc.conv_in.weight, RGB, RGB, current)
    enc.conv_in.bias[CONST] = K
    time_downs = []
    for module in enc.down_blocks:
        if isinstance(module, WanResample):
            conv = module.resample[1]
            for c in range(conv.weight.shape[0]):
                conv.weight[c, c, 0:2, 0:2] = 0.25   # 2 x 2 average
            if module.mode == "downsample3d":
                time_downs.append(module.time_conv)
    first, second = time_downs
    # 5 frames (the last of the previous chunk, f1..f4) -> taps (prev, f1, f2) and (f2, f3, f4)
    _copy(first.weight, RGB, RGB, (1, 0, 0))
    _copy(first.weight, GROUPS[1], RGB, (2, 0, 0))
    first.weight[CONST, CONST, 2, 0, 0] = 1
    # (prev, o0, o1) -> f1 f2 from o0, f3 f4 from o1
    _copy(second.weight, GROUPS[0] + GROUPS[1], GROUPS[0] + GROUPS[1], (1, 0, 0))
    _copy(second.weight, GROUPS[2] + GROUPS[3], GROUPS[0] + GROUPS[1], (2, 0, 0))
    second.weight[CONST, CONST, 2, 0, 0] = 1
    enc.norm_out.gamma.fill_(GAMMA)
    channels = enc.norm_out.gamma.shape[0]
    head = 2 * K / (channels ** 0.5 * GAMMA)
    latent = [c for group in GROUPS for c in group]          # 12 channels
    for z, c in enumerate(latent):
        enc.conv_out.weight[c, c, 2, 1, 1] = head
        vae.quant_conv.weight[z, c, 0, 0, 0] = 1
    z_dim = vae.config.z_dim
    vae.quant_conv.bias[z_dim:] = -8.0      # log variance: the posterior is nearly its mean
    # decoder
    _copy(vae.post_quant_conv.weight, range(z_dim), range(z_dim), (0, 0, 0))
    for z, c in enumerate(latent):
        dec.conv_in.weight[c, z, 2, 1, 1] = 1
    dec.conv_in.bias[CONST] = K
    time_ups = []
    for block in dec.up_blocks:
        for module in (block.upsamplers or []):
            conv = module.resample[1]
            n = min(conv.weight.shape[:2])
            _copy(conv.weight, range(n), range(n), (1, 1))
            if module.mode == "upsample3d":
                time_ups.append(module.time_conv)
    first, second = time_ups
    half = first.weight.shape[0] // 2
    # frame 2t keeps f1 f2 (groups 0, 1), frame 2t+1 takes f3 f4 (groups 2, 3) into groups 0, 1
    _copy(first.weight, GROUPS[0] + GROUPS[1] + [CONST], GROUPS[0] + GROUPS[1] + [CONST], (2, 0, 0))
    _copy(first.weight, [half + c for c in GROUPS[0] + GROUPS[1] + [CONST]], GROUPS[2] + GROUPS[3] + [CONST], (2, 0, 0))
    half = second.weight.shape[0] // 2
    _copy(second.weight, RGB + [CONST], RGB + [CONST], (2, 0, 0))
    _copy(second.weight, [half + c for c in RGB + [CONST]], GROUPS[1] + [CONST], (2, 0, 0))
    dec.norm_out.gamma.fill_(GAMMA)
    channels = dec.norm_out.gamma.shape[0]
    head = 2 * K / (channels ** 0.5 * GAMMA)
    _copy(dec.conv_out.weight, RGB, RGB, (2, 1, 1))
    dec.conv_out.weight.mul_(head)
    # the mid-block norms
    for module in vae.modules():
        if type(module).__name__ == "WanRMS_norm" and module.gamma.abs().sum() == 0:
            module.gamma.fill_(1.0)
