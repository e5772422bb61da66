"""Wan2.2-Animate's face adapter in LoRA files: the official and ComfyUI models hold key and value in one Linear,
`face_adapter.fuser_blocks.N.linear1_kv` (output rows: key, then value; Wan-Video/Wan2.2
wan/modules/animate/face_blocks.py `FaceBlock`, ComfyUI comfy/ldm/wan/model_animate.py), where diffusers has `to_k`
and `to_v`. Files in the official names therefore hold one `linear1_kv` adapter (keys.py names it
`face_adapter.N.linear1_kv`), diffusers-named files and training the two.

Both ways are exact:
- fusing: down = [down_k; down_v] (2r rows), up = [[up_k, 0], [0, up_v]] (block diagonal), alpha doubled, so that
  up @ down * alpha / rank = [up_k down_k; up_v down_v] * alpha_k / r: the stacked weight's update is the two
  updates stacked (a DoRA magnitude, per output row, is stacked the same way);
- splitting: to_k takes down and up's key rows, to_v down and up's value rows, alpha as it is: any `linear1_kv`
  adapter (also one trained on the fused layer elsewhere) splits into two of its rank with the same updates."""
import re

import torch

from modules.util.lora.LoraModule import LoraModule

_FUSED = re.compile(r"^face_adapter\.(\d+)\.linear1_kv$")
_SPLIT = re.compile(r"^face_adapter\.(\d+)\.to_([kv])$")


def fuse_face_key_value(weights: dict) -> dict:
    """`weights` (diffusers module name -> LoraModule) with each face adapter block's to_k / to_v pair as one
    `face_adapter.N.linear1_kv` module; other modules as they are. LoHa / LoKr adapters on them cannot be stacked
    (ValueError)."""
    out, pairs = {}, {}
    for name, module in weights.items():
        match = _SPLIT.match(name)
        if match is None:
            out[name] = module
            continue
        if not isinstance(module, LoraModule):
            raise ValueError(f"{name}: a {type(module).__name__} adapter on the face adapter's key or value cannot be "
                             f"written in the official layout, which stacks them in one Linear (linear1_kv); train "
                             f"the face adapter with lora.type LORA, or leave lora.face_adapter off")
        pairs.setdefault(match.group(1), {})[match.group(2)] = module
    for index, pair in pairs.items():
        if set(pair) != {"k", "v"}:
            missing = ({"k", "v"} - set(pair)).pop()
            raise ValueError(f"face_adapter.{index}: an adapter on to_{'k' if missing == 'v' else 'v'} without one "
                             f"on to_{missing}; the official layout stacks them (linear1_kv): adapt both")
        key, value = pair["k"], pair["v"]
        if key.scale != value.scale:
            raise ValueError(f"face_adapter.{index}: to_k and to_v have different alpha / rank; the stacked "
                             f"linear1_kv adapter takes one")
        if (key.dora_scale is None) != (value.dora_scale is None):
            raise ValueError(f"face_adapter.{index}: DoRA on only one of to_k and to_v")
        up = torch.zeros(key.up.shape[0] + value.up.shape[0], key.rank + value.rank, dtype=key.up.dtype)
        up[:key.up.shape[0], :key.rank] = key.up
        up[key.up.shape[0]:, key.rank:] = value.up
        down = torch.cat([key.down, value.down.to(key.down.dtype)])
        dora = None if key.dora_scale is None else torch.cat([key.dora_scale.reshape(-1, 1),
                                                              value.dora_scale.reshape(-1, 1)])
        # alpha / rank is kept: rank doubles, so does alpha
        out[f"face_adapter.{index}.linear1_kv"] = LoraModule(down=down, up=up, alpha=key.scale * (key.rank +
                                                                                                   value.rank),
                                                             dora_scale=dora)
    return out


def split_face_key_value(weights: dict) -> dict:
    """`weights` with each `face_adapter.N.linear1_kv` module as diffusers' to_k and to_v modules."""
    out = {}
    for name, module in weights.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = module
            continue
        if not isinstance(module, LoraModule):
            raise ValueError(f"{name}: a {type(module).__name__} adapter on the face adapter's stacked key and value "
                             f"cannot be split into diffusers' to_k and to_v")
        half = module.up.shape[0] // 2
        dora = module.dora_scale
        for which, rows in (("k", slice(0, half)), ("v", slice(half, None))):
            out[f"face_adapter.{match.group(1)}.to_{which}"] = LoraModule(
                down=module.down.clone(), up=module.up[rows].clone(), alpha=module.alpha,
                dora_scale=None if dora is None else dora.reshape(-1, 1)[rows])
    return out
