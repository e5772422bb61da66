"""Analytic FLOP count of a WanTransformer3DModel training step (one multiply-add = 2 FLOPs).

Counted: every matrix product, as the diffusers module runs them for batch B, L = T * h/2 * w/2 video tokens
(T, h, w: latent frames, height, width; patch 1x2x2) and S = 512 text tokens, width d, FFN width f:

- per block (x num_layers), on the base weights:
    self-attention projections q, k, v, out      4 x 2 d^2 per video token
    self-attention scores and values             4 L^2 d per sample (QK^T and PV, each 2 L^2 d)
    cross-attention q and out projections         2 x 2 d^2 per video token
    cross-attention k and v projections           2 x 2 d^2 per text token
    cross-attention scores and values             4 L S d per sample
    feed-forward d -> f -> d                      2 x 2 d f per video token
- LoRA adapters of rank r on the wrapped Linear(in, out): 2 r (in + out) per token it sees
- outside the blocks (not recomputed by gradient checkpointing): the patch embedding (a strided Conv3d, a linear
  map of c_in x 1 x 2 x 2 values to d per video token), the text embedder (text_dim -> d -> d per text token), the
  time embedder (256 -> d -> d) and time projection (d -> 6d) per timestep (per sample; per video token for
  TI2V-5B's per-token timesteps), and the output projection (d -> c_out x 4 per video token).

Not counted: norms, rope, modulation, activations, softmax, the loss and the optimizer (elementwise, small).

A training step costs 3 x forward (the backward pass computes gradients for inputs and weights, 2 x forward: the
usual convention, kept for LoRA too although frozen weights need no weight gradient). Gradient checkpointing
recomputes every block's forward once more during the backward pass (4 x the blocks' forward). "Model FLOPs"
(for MFU) leave the recomputation out; "hardware FLOPs" (for HFU) include it.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

TEXT_TOKENS = 512
LORA_ATTENTION = r"attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
LORA_MLP = r"ffn\.(net\.0\.proj|net\.2)"


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one step by part; `model` and `hardware` give the training step's totals."""

    blocks_linear: int       # base-weight projections inside the blocks
    blocks_attention: int    # attention score / value products inside the blocks
    blocks_lora: int         # LoRA adapters (all inside the blocks)
    outer: int               # patch embedding, condition embedder, output projection
    video_tokens: int        # L (per sample)
    checkpointing: bool
    recomputed_fraction: float = 1.0   # share of the blocks checkpointed (performance.checkpoint_every, block swap)

    @property
    def forward(self) -> int:
        return self.blocks_linear + self.blocks_attention + self.blocks_lora + self.outer

    @property
    def blocks(self) -> int:
        return self.blocks_linear + self.blocks_attention + self.blocks_lora

    @property
    def model(self) -> int:
        """Forward + backward (3 x forward): the FLOPs of the step without recomputation (MFU)."""
        return 3 * self.forward

    @property
    def hardware(self) -> int:
        """`model` plus the blocks' forward recomputed by gradient checkpointing (HFU)."""
        return self.model + (round(self.blocks * self.recomputed_fraction) if self.checkpointing else 0)

    def as_dict(self) -> dict:
        return {**asdict(self), "forward": self.forward, "model": self.model, "hardware": self.hardware}


def block_linears(dim: int, ffn_dim: int) -> list[tuple[str, int, int, str]]:
    """(module name inside a block, in features, out features, 'video' or 'text' tokens) of each Linear."""
    return [
        ("attn1.to_q", dim, dim, "video"), ("attn1.to_k", dim, dim, "video"),
        ("attn1.to_v", dim, dim, "video"), ("attn1.to_out.0", dim, dim, "video"),
        ("attn2.to_q", dim, dim, "video"), ("attn2.to_k", dim, dim, "text"),
        ("attn2.to_v", dim, dim, "text"), ("attn2.to_out.0", dim, dim, "video"),
        ("ffn.net.0.proj", dim, ffn_dim, "video"), ("ffn.net.2", ffn_dim, dim, "video"),
    ]


def lora_pattern(targets: str) -> re.Pattern | None:
    """The block-relative names a LoRA preset wraps (see WanLoRASetup.TARGET_PRESETS); None: no adapter."""
    if targets in ("none", "", None):
        return None
    if targets == "attn-only":
        return re.compile(LORA_ATTENTION)
    if targets == "attn-mlp":
        return re.compile(f"({LORA_ATTENTION}|{LORA_MLP})")
    if targets == "blocks-full":
        return re.compile(r".+")
    raise ValueError(f"unknown LoRA targets {targets!r}")


def count_flops(transformer_config: dict, latent_frames: int, latent_height: int, latent_width: int,
                batch_size: int = 1, text_tokens: int = TEXT_TOKENS, lora_rank: int = 0,
                lora_targets: str = "attn-mlp", per_token_timesteps: bool = False,
                checkpointing: bool = False, recomputed_layers: int | None = None) -> FlopCount:
    """The FLOP count of one training step of a WanTransformer3DModel with `transformer_config` (its kwargs) on
    latents of (latent_frames, latent_height, latent_width), batch `batch_size`. `recomputed_layers`: how many
    blocks checkpointing recomputes (default: all of them when `checkpointing`). See the module doc."""
    c = transformer_config
    p_t, p_h, p_w = c["patch_size"]
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    ffn = c["ffn_dim"]
    layers = c["num_layers"]
    if c.get("added_kv_proj_dim") is not None or c.get("image_dim") is not None:
        raise NotImplementedError("the FLOP count covers the text-only transformers (no image branch)")
    video = (latent_frames // p_t) * (latent_height // p_h) * (latent_width // p_w)
    tokens = {"video": batch_size * video, "text": batch_size * text_tokens}

    linear = sum(2 * i * o * tokens[kind] for _, i, o, kind in block_linears(dim, ffn))
    attention = batch_size * (4 * video * video * dim + 4 * video * text_tokens * dim)
    pattern = lora_pattern(lora_targets) if lora_rank else None
    lora = 0
    if pattern is not None:
        lora = sum(2 * lora_rank * (i + o) * tokens[kind] for name, i, o, kind in block_linears(dim, ffn)
                   if pattern.fullmatch(name))

    timesteps = batch_size * video if per_token_timesteps else batch_size
    outer = (2 * tokens["video"] * c["in_channels"] * p_t * p_h * p_w * dim        # patch embedding
             + 2 * tokens["text"] * (c["text_dim"] * dim + dim * dim)                # text embedder
             + 2 * timesteps * (c["freq_dim"] * dim + dim * dim + dim * 6 * dim)     # time embedder + projection
             + 2 * tokens["video"] * dim * c["out_channels"] * p_t * p_h * p_w)      # output projection
    return FlopCount(blocks_linear=layers * linear, blocks_attention=layers * attention, blocks_lora=layers * lora,
                     outer=outer, video_tokens=video, checkpointing=checkpointing,
                     recomputed_fraction=1.0 if recomputed_layers is None else recomputed_layers / layers)
