from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class PerformanceConfig(BaseConfig):
    """Memory and speed switches (docs/benchmarks.md). None of them changes what is learned: each leaves the loss and
    gradients of a fixed-seed step unchanged (exactly in float32, within bf16 noise otherwise); they trade speed for
    memory or the reverse."""

    checkpoint_every: int = Field(1, ge=1, le=1024,
                                  description="with gradient_checkpointing on: checkpoint every k-th "
                                                       "transformer block (1: every block, least memory; 2: every "
                                                       "other block, faster, more memory)")
    block_swap: int = Field(0, ge=0, le=1024,
                            description="transformer blocks (the last N) whose frozen weights live in "
                                                 "pinned CPU memory and are copied to the GPU just before they run, "
                                                 "forward and backward; these blocks are always checkpointed")
    recompute_norms: bool = Field(True, description="keep only the bf16 input of the transformer's float32 norms "
                                                    "and recompute them in the backward pass instead of keeping "
                                                    "their float32 copies: the same numbers, about 0.56 GiB "
                                                    "less per block that keeps its activations at 832x480x81 "
                                                    "(Wan 1.3B), a few elementwise passes more per block")
    chunk_tokens: int = Field(4096, ge=0, le=1_000_000,
                              description="run each transformer block's per-token parts (everything after the "
                                          "self-attention's kernel: its output projection, the residual adds, the "
                                          "cross-attention, the feed-forward; and the recomputed norms) on this "
                                          "many tokens at a time (0: all at once); in "
                                          "a checkpointed block each chunk is recomputed alone in the backward "
                                          "pass, so the widest tensors (the feed-forward's 8,960 / 13,824 wide "
                                          "hidden state, the norms' float32 temporaries) exist for one chunk "
                                          "only: about 2.4 GiB less at the 1.3B's peak at 832x480x81, no extra "
                                          "compute but the cross-attention's text keys and values once per "
                                          "chunk. Equal within float32 rounding (weight gradients are summed "
                                          "chunk by chunk)")
    chunk_attention_inputs: bool = Field(False, description="with chunk_tokens, also run each checkpointed block's "
                                                            "self-attention inputs (its norm, the q/k/v projections, "
                                                            "their norms, the rotary embedding) in token chunks, "
                                                            "recomputed alone in the backward pass instead of kept: "
                                                            "about 0.3 GiB less at the 1.3B's peak at 832x480x81, "
                                                            "one more forward pass of those parts per block (about "
                                                            "1 % of a step). Equal within float32 rounding")
    activation_offload: bool = Field(False, description="keep the inputs of checkpointed blocks in pinned CPU memory "
                                                        "and copy them back for the backward pass (needs "
                                                        "gradient_checkpointing)")
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="scaled-dot-product attention kernel: auto lets torch pick the fastest available; flash "
                            "(AOTriton on ROCm; also on the CPU), cudnn and efficient are GPU kernels; math is the "
                            "reference")
    compile_blocks: bool = Field(False, description="torch.compile each (non-swapped) transformer block: one compiled "
                                                    "region reused by every block, so compiling takes seconds")
    auto_fit: float = Field(0.0, ge=0, le=4096,
                            description="fit the run to a card of this many GiB at start (0: off): the memory "
                                        "planner picks the fastest checkpointing / block swap / activation offload "
                                        "whose predicted peak fits and uses it (docs/benchmarks.md)")
    vae_tiling: bool = Field(False, description="encode and decode with the VAE in spatial tiles: high resolutions "
                                                "fit in less memory, at a small cost in speed")
    cache_latents_bf16: bool = Field(True, description="store cached latents in bfloat16 (half the disk and "
                                                       "host-to-device traffic; training upcasts them)")
    loss_readback_steps: int = Field(10, ge=1, le=1_000_000,
                                     description="read the losses back from the device every N steps "
                                                           "(a read waits for the device); non-finite losses are "
                                                           "caught at the next read, and always before a backup "
                                                           "or a save")
