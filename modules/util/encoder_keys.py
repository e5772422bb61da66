"""Key names of the Wan text and image encoders in the layouts users hold them, against transformers' names; shared
by the loaders (modules/modelLoader/wan/parts/) and the tiny-file writers (modules/util/tiny_model_files.py).

Sources (facts, not code):
- official Wan T5 (`models_t5_umt5-xxl-enc-bf16.pth`): `T5Encoder` in Wan-Video/Wan2.1 `wan/modules/t5.py`, built by
  `umt5_xxl(encoder_only=True)` with `shared_pos=False` (a relative position embedding in every block, as UMT5);
  its feed-forward is `fc2(fc1(x) * gelu_tanh(gate.0(x)))`, transformers' gated-gelu `wo(wi_1(x) * gelu_new(wi_0(x)))`.
- ComfyUI text encoders: transformers' names (comfy/text_encoders/t5.py), the tokenizer's sentencepiece model as a
  uint8 `spiece_model` tensor (comfy/text_encoders/spiece_tokenizer.py, read in comfy/sd.py for CLIPType.WAN),
  fp8_scaled marked by a `scaled_fp8` tensor with a `scale_weight` per Linear (comfy/ops.py `scaled_fp8_ops`).
"""
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# official Wan T5Encoder block names -> transformers UMT5 block names (T5SelfAttention in wan/modules/t5.py)
WAN_T5_BLOCK_NAMES = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
WAN_T5_TOP_NAMES = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}

SCALED_FP8_MARKER = "scaled_fp8"
SPIECE_MODEL_KEY = "spiece_model"


# --- CLIP vision tower ---------------------------------------------------------------------------------------------
# Names are transformers' CLIPVisionModel module names (its files add `vision_model.`).
# - official Wan CLIP (`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`): `VisionTransformer` of Wan-Video/
#   Wan2.1 `wan/modules/clip.py` under `visual.` (pool_type "token", pre_norm, no conv bias): `cls_embedding`
#   [1, 1, D], `pos_embedding` [1, L, D], `transformer.N.attn.to_qkv` fused [3D, D] (q, k, v stacked on dim 0,
#   as its forward views it [b, s, 3, n, d]), `attn.proj`, `mlp.0` / `mlp.2` (Linear, GELU, Linear), `head` [D, E]
#   (a parameter used as x @ head); the `textual.` XLM-RoBERTa tower and `log_scale` are not the image encoder.
# - open_clip ViT (`visual.conv1`, `class_embedding` [D], `positional_embedding` [L, D], `ln_pre`,
#   `transformer.resblocks.N.{ln_1, attn.in_proj_weight/bias, attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`,
#   `ln_post`, `proj` [D, E]): mlfoundations/open_clip `transformer.py` VisionTransformer, as ComfyUI's
#   comfy/clip_vision.py `convert_to_transformers` maps it (in_proj split in three, `proj` transposed into
#   `visual_projection.weight`).
_WAN_CLIP_LAYER = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
                   "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}
_OPEN_CLIP_LAYER = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                    "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_WAN_CLIP_TOP = {"patch_embedding.weight": "embeddings.patch_embedding.weight", "pre_norm": "pre_layrnorm",
                 "post_norm": "post_layernorm"}
_OPEN_CLIP_TOP = {"conv1.weight": "embeddings.patch_embedding.weight", "ln_pre": "pre_layrnorm",
                  "ln_post": "post_layernorm"}
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class ClipSource:
    """Where a transformers CLIP tensor comes from in another layout's file."""
    key: str
    chunk: int | None = None        # which third (q, k, v) of a fused [3D, ...] tensor
    ndim: int | None = None         # leading unit dims dropped: [1, 1, D] -> [D], [1, L, D] -> [L, D]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.chunk is not None:
            tensor = tensor.chunk(3, dim=0)[self.chunk]
        if self.ndim is not None:
            tensor = tensor.reshape(tensor.shape[-self.ndim:])
        return tensor


def clip_vision_sources(keys: Iterable[str], layout: str, prefix: str = "visual.") -> dict[str, ClipSource]:
    """transformers CLIPVisionModel name -> source, for the "wan" or "open_clip" layout's `visual.` keys (keys it
    does not know are returned under their own name, for the loader's key check to report)."""
    top, layer, fused = ((_WAN_CLIP_TOP, _WAN_CLIP_LAYER, "attn.to_qkv") if layout == "wan"
                         else (_OPEN_CLIP_TOP, _OPEN_CLIP_LAYER, "attn.in_proj"))
    blocks = r"transformer\.(\d+)\." if layout == "wan" else r"transformer\.resblocks\.(\d+)\."
    sources: dict[str, ClipSource] = {}
    for key in keys:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        if rest in ("head", "proj"):
            continue   # the projection to the joint embedding: not in CLIPVisionModel, unused by Wan
        if rest in ("cls_embedding", "class_embedding"):
            sources["embeddings.class_embedding"] = ClipSource(key, ndim=1)
        elif rest in ("pos_embedding", "positional_embedding"):
            sources["embeddings.position_embedding.weight"] = ClipSource(key, ndim=2)
        elif match := re.match(rf"^{blocks}(.+)$", rest):
            index, name = match[1], match[2]
            base = f"encoder.layers.{index}."
            if name.startswith(fused):
                suffix = "weight" if name.endswith("weight") else "bias"   # to_qkv.weight / in_proj_weight
                for chunk, proj in enumerate(_QKV):
                    sources[f"{base}self_attn.{proj}.{suffix}"] = ClipSource(key, chunk=chunk)
                continue
            module, _, param = name.rpartition(".")
            sources[base + f"{layer.get(module, module)}.{param}"] = ClipSource(key)
        else:
            module, _, param = rest.rpartition(".")
            if rest in top:
                sources[top[rest]] = ClipSource(key)
            else:
                sources[f"{top.get(module, module)}.{param}"] = ClipSource(key)
    return sources
