"""Names of the Wan transformer's weights: official Wan ("original", as ComfyUI and the Wan repo name them) <->
diffusers' `WanTransformer3DModel`.

Covers Wan 2.1 T2V / I2V / FLF2V, Wan 2.2 TI2V-5B / A14B (T2V and I2V), VACE's extra blocks and Animate's face
adapter. Both directions come from the one
table `KEY_TABLE` below (DESIGN.md section 7). Each row names a module or a parameter on both sides; a key maps
when it is the name itself or the name followed by `.<anything>` (`.weight`, `.bias`, `.lora_A.weight`, ...).

No tensor needs reshaping: every pair has the same shape in both formats (`blocks.N.modulation` and
`blocks.N.scale_shift_table` are both (1, 6, dim); `head.modulation` and `scale_shift_table` both (1, 2, dim);
`img_emb.emb_pos` and `condition_embedder.image_embedder.pos_embed` both (1, tokens, image_dim)). The converters
return the same tensor objects under new names; nothing is copied.

Note on peers: diffusers' own single-file converter (`convert_wan_transformer_to_diffusers`, diffusers 0.42)
does not rename `img_emb.emb_pos` (FLF2V) and does not strip a bare `diffusion_model.` prefix; ComfyUI reads all
three prefixes (none, `diffusion_model.`, `model.diffusion_model.`).
"""
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

V = TypeVar("V")

# (original Wan name, diffusers name). "{N}" is a block index. Rows with no parameters in either model (norm1,
# head.norm) are listed so module names of every layer map; they never appear in a state dict.
KEY_TABLE: tuple[tuple[str, str], ...] = (
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    # I2V / FLF2V image (CLIP) embedding: Sequential(LayerNorm, Linear, GELU, Linear, LayerNorm)
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),  # FLF2V only, parameter
    # transformer blocks
    ("blocks.{N}.modulation", "blocks.{N}.scale_shift_table"),  # parameter (1, 6, dim)
    ("blocks.{N}.norm1", "blocks.{N}.norm1"),  # no parameters
    ("blocks.{N}.norm3", "blocks.{N}.norm2"),  # the cross-attention norm: the names are swapped
    ("blocks.{N}.norm2", "blocks.{N}.norm3"),  # no parameters
    ("blocks.{N}.self_attn.q", "blocks.{N}.attn1.to_q"),
    ("blocks.{N}.self_attn.k", "blocks.{N}.attn1.to_k"),
    ("blocks.{N}.self_attn.v", "blocks.{N}.attn1.to_v"),
    ("blocks.{N}.self_attn.o", "blocks.{N}.attn1.to_out.0"),
    ("blocks.{N}.self_attn.norm_q", "blocks.{N}.attn1.norm_q"),
    ("blocks.{N}.self_attn.norm_k", "blocks.{N}.attn1.norm_k"),
    ("blocks.{N}.cross_attn.q", "blocks.{N}.attn2.to_q"),
    ("blocks.{N}.cross_attn.k", "blocks.{N}.attn2.to_k"),
    ("blocks.{N}.cross_attn.v", "blocks.{N}.attn2.to_v"),
    ("blocks.{N}.cross_attn.o", "blocks.{N}.attn2.to_out.0"),
    ("blocks.{N}.cross_attn.norm_q", "blocks.{N}.attn2.norm_q"),
    ("blocks.{N}.cross_attn.norm_k", "blocks.{N}.attn2.norm_k"),
    ("blocks.{N}.cross_attn.k_img", "blocks.{N}.attn2.add_k_proj"),  # Wan 2.1 I2V / FLF2V
    ("blocks.{N}.cross_attn.v_img", "blocks.{N}.attn2.add_v_proj"),
    ("blocks.{N}.cross_attn.norm_k_img", "blocks.{N}.attn2.norm_added_k"),
    ("blocks.{N}.ffn.0", "blocks.{N}.ffn.net.0.proj"),
    ("blocks.{N}.ffn.2", "blocks.{N}.ffn.net.2"),
    # output head
    ("head.norm", "norm_out"),  # no parameters
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),  # parameter (1, 2, dim)
)
# VACE (Wan-Video/Wan2.1 wan/modules/vace_model.py `VaceWanModel`; diffusers `WanVACETransformer3DModel`): each
# `vace_blocks.N` is a Wan block with the same inner names, plus `before_proj` (block 0 only) / `after_proj`, which
# diffusers names `proj_in` / `proj_out` (its single-file converter's "before_proj" / "after_proj" renames)
KEY_TABLE += (
    ("vace_patch_embedding", "vace_patch_embedding"),
    ("vace_blocks.{N}.before_proj", "vace_blocks.{N}.proj_in"),
    ("vace_blocks.{N}.after_proj", "vace_blocks.{N}.proj_out"),
    *((f"vace_{original}", f"vace_{diffusers}") for original, diffusers in KEY_TABLE if original.startswith("blocks.")),
)

# Wan2.2-Animate's face adapter (Wan-Video/Wan2.2 wan/modules/animate/face_blocks.py `FaceBlock`, the same names in
# ComfyUI's comfy/ldm/wan/model_animate.py; diffusers `WanAnimateFaceBlock`). The official `linear1_kv` holds key and
# value stacked on its output rows where diffusers has `to_k` and `to_v`: LoRA files name it as the pseudo module
# `face_adapter.N.linear1_kv`, which modules/util/lora/face_adapter.py splits and fuses
KEY_TABLE += (
    ("face_adapter.fuser_blocks.{N}.linear1_q", "face_adapter.{N}.to_q"),
    ("face_adapter.fuser_blocks.{N}.linear1_kv", "face_adapter.{N}.linear1_kv"),
    ("face_adapter.fuser_blocks.{N}.linear2", "face_adapter.{N}.to_out"),
    ("face_adapter.fuser_blocks.{N}.q_norm", "face_adapter.{N}.norm_q"),
    ("face_adapter.fuser_blocks.{N}.k_norm", "face_adapter.{N}.norm_k"),
)

# Longest first: "model.diffusion_model.x" does not start with "diffusion_model.", but keep the order explicit.
ORIGINAL_PREFIXES: tuple[str, ...] = ("model.diffusion_model.", "diffusion_model.")

_ORIGINAL_MARKER = re.compile(
    r"^((vace_)?blocks\.\d+\.(block\.|self_attn|cross_attn|modulation|ffn\.[02]\b|before_proj|after_proj)|head\."
    r"|text_embedding\.|time_embedding\.|time_projection\.|img_emb\.|face_adapter\.fuser_blocks\.)"
)


# Wan2.2-Animate-2: the official code wraps each block (`blocks.N.block.self_attn.q`); diffusers'
# `WanAnimate2Transformer3DModel` keeps the official names but for the attention projections
# (`blocks.N.self_attn.to_q`) and drops the wrapper. Its other names are the same on both sides.
ANIMATE_2_ATTENTION = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj",
                       "v_img": "add_v_proj", "norm_k_img": "norm_added_k"}
_ANIMATE_2_OFFICIAL = re.compile(r"^blocks\.(\d+)\.block\.(.+)$")
_ANIMATE_2_DIFFUSERS = re.compile(r"^blocks\.(\d+)\.(self_attn|cross_attn)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|"
                                  r"add_v_proj|norm_added_k)(\..+)?$")
# diffusers' names of an Animate-2 block that no WanTransformer3DModel name has (attn1 / attn2 / ffn.net there)
_ANIMATE_2_BLOCK = re.compile(r"^blocks\.\d+\.(self_attn|cross_attn|ffn\.[02])(\.|$)")


def animate_2_to_diffusers(name: str) -> str:
    """`blocks.N.block.self_attn.q...` -> `blocks.N.self_attn.to_q...`; names outside the blocks are kept."""
    match = _ANIMATE_2_OFFICIAL.match(name)
    if match is None:
        return name
    rest = match.group(2)
    attention = re.match(r"^(self_attn|cross_attn)\.([a-z_]+)(\..+)?$", rest)
    if attention is not None and attention.group(2) in ANIMATE_2_ATTENTION:
        rest = f"{attention.group(1)}.{ANIMATE_2_ATTENTION[attention.group(2)]}{attention.group(3) or ''}"
    return f"blocks.{match.group(1)}.{rest}"


def animate_2_to_original(name: str) -> str:
    """The inverse of animate_2_to_diffusers."""
    match = _ANIMATE_2_DIFFUSERS.match(name)
    if match is not None:
        official = {v: k for k, v in ANIMATE_2_ATTENTION.items()}[match.group(3)]
        return f"blocks.{match.group(1)}.block.{match.group(2)}.{official}{match.group(4) or ''}"
    if name.startswith("blocks."):
        index, rest = name.removeprefix("blocks.").split(".", 1)
        return f"blocks.{index}.block.{rest}"
    return name


def is_animate_2_modules(names: Iterable[str]) -> bool:
    """diffusers module names of a `WanAnimate2Transformer3DModel` (self_attn / cross_attn / ffn.0 in its blocks,
    which WanTransformer3DModel names attn1 / attn2 / ffn.net)."""
    return any(_ANIMATE_2_BLOCK.match(name) for name in names)


def names_animate_2_attention(names: Iterable[str]) -> bool:
    """Some name is one of diffusers' Animate-2 attention projections (`blocks.N.self_attn.to_q`): in a file, what
    tells its diffusers names from the official names of the other Wan models (`blocks.N.self_attn.q`)."""
    return any(_ANIMATE_2_DIFFUSERS.match(name) for name in names)


def _compile(template: str) -> re.Pattern[str]:
    body = re.escape(template).replace(re.escape("{N}"), r"(?P<N>\d+)")
    return re.compile(rf"^{body}(?P<rest>\..+)?$")


_RULES: tuple[tuple[re.Pattern[str], str, re.Pattern[str], str], ...] = tuple(
    (_compile(original), original, _compile(diffusers), diffusers) for original, diffusers in KEY_TABLE
)
_TO_DIFFUSERS = tuple((src, dst) for src, _, _, dst in _RULES)
_TO_ORIGINAL = tuple((src, dst) for _, dst, src, _ in _RULES)


def _rename(name: str, rules: tuple[tuple[re.Pattern[str], str], ...]) -> str | None:
    for pattern, target in rules:
        match = pattern.match(name)
        if match is not None:
            renamed = target.replace("{N}", match.group("N")) if "{N}" in target else target
            return renamed + (match.group("rest") or "")
    return None


def detect_original_prefix(keys: Iterable[str]) -> str:
    """The prefix the original-format keys carry: `model.diffusion_model.`, `diffusion_model.` or ``."""
    keys = list(keys)
    for prefix in ORIGINAL_PREFIXES:
        if any(key.startswith(prefix) for key in keys):
            return prefix
    return ""


def strip_original_prefix(sd: Mapping[str, V]) -> dict[str, V]:
    """Removes a `model.diffusion_model.` or `diffusion_model.` prefix. When keys carry one, keys without it (the
    VAE or text encoder of a full checkpoint) are dropped, as ComfyUI does; without a prefix, a shallow copy."""
    prefix = detect_original_prefix(sd.keys())
    if not prefix:
        return dict(sd)
    return {key[len(prefix):]: value for key, value in sd.items() if key.startswith(prefix)}


def is_original_format(keys: Iterable[str]) -> bool:
    """True if the keys (state dict or LoRA, any of the original prefixes) use the official Wan naming, e.g.
    `blocks.0.self_attn.q.weight`; diffusers' names (`blocks.0.attn1.to_q.weight`) give False."""
    keys = list(keys)
    prefix = detect_original_prefix(keys)
    return any(_ORIGINAL_MARKER.match(key[len(prefix):]) for key in keys if key.startswith(prefix))


def _convert(sd: Mapping[str, V], rules, source: str, strict: bool) -> dict[str, V]:
    out: dict[str, V] = {}
    for key, value in sd.items():
        new_key = _rename(key, rules)
        if new_key is None:
            if strict:
                raise KeyError(f"Wan {source} key {key!r} has no counterpart in the key table (modules/util/lora/keys.py)")
            new_key = key
        if new_key in out:
            raise ValueError(f"Wan {source} keys collide: two keys map to {new_key!r} (last: {key!r})")
        out[new_key] = value
    return out


def original_to_diffusers_state_dict(sd: Mapping[str, V], strict: bool = True) -> dict[str, V]:
    """Official Wan transformer state dict (no prefix, `diffusion_model.` or `model.diffusion_model.`) -> diffusers
    `WanTransformer3DModel` keys. Unknown keys raise KeyError, or pass through unchanged with strict=False."""
    return _convert(strip_original_prefix(sd), _TO_DIFFUSERS, "original", strict)


def diffusers_to_original_state_dict(sd: Mapping[str, V], prefix: str = "", strict: bool = True) -> dict[str, V]:
    """diffusers `WanTransformer3DModel` state dict -> official Wan keys, each prefixed with `prefix` (``,
    `diffusion_model.` or `model.diffusion_model.`). Exact inverse of `original_to_diffusers_state_dict`."""
    converted = _convert(sd, _TO_ORIGINAL, "diffusers", strict)
    if not prefix:
        return converted
    return {prefix + key: value for key, value in converted.items()}


def diffusers_module_to_original(name: str) -> str:
    """`blocks.0.attn1.to_q` -> `blocks.0.self_attn.q`; trailing parts (`.lora_A`) are kept."""
    renamed = _rename(name, _TO_ORIGINAL)
    if renamed is None:
        raise KeyError(f"diffusers Wan module {name!r} has no original Wan name (modules/util/lora/keys.py KEY_TABLE)")
    return renamed


def original_module_to_diffusers(name: str) -> str:
    """`blocks.0.self_attn.q` (optionally prefixed `diffusion_model.` / `model.diffusion_model.`) ->
    `blocks.0.attn1.to_q`; trailing parts (`.lora_A`) are kept."""
    for prefix in ORIGINAL_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if _ANIMATE_2_OFFICIAL.match(name):
        return animate_2_to_diffusers(name)
    renamed = _rename(name, _TO_DIFFUSERS)
    if renamed is None:
        raise KeyError(f"original Wan module {name!r} has no diffusers name (modules/util/lora/keys.py KEY_TABLE)")
    return renamed

