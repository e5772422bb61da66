"""Wan2.2-Animate and Animate-2 transformers in the official / ComfyUI key names <-> diffusers'
`WanAnimateTransformer3DModel` / `WanAnimate2Transformer3DModel`.

Official Animate names (facts, from Wan-Video/Wan2.2 `wan/modules/animate/`: model_animate.py `WanAnimateModel`,
motion_encoder.py `Generator`, face_blocks.py `FaceEncoder` / `FaceAdapter`; the names and shapes are in
tests/fixtures/official_animate_key_names.json):
- the Wan blocks, head and embeddings as in every Wan model (modules/util/lora/keys.py), `img_emb.proj.*` 1280 wide,
  `cross_attn.k_img` / `v_img` as wide as the model (`added_kv_proj_dim` = width: without it diffusers'
  `from_single_file` drops them with a warning), `pose_patch_embedding` (16 latent channels -> width);
- `motion_encoder.enc.net_app.convs.0.{0.weight, 1.bias}`, `convs.K.{conv1.0.weight, conv1.1.bias,
  conv2.0.kernel, conv2.1.weight, conv2.2.bias, skip.0.kernel, skip.1.weight}` for the residual blocks K = 1..n,
  `convs.{n+1}.weight`, `motion_encoder.enc.fc.{0..4}.{weight,bias}`, `motion_encoder.dec.direction.weight`;
  the fused-activation biases are (1, C, 1, 1) and the `kernel`s are the fixed blur filter [1, 3, 3, 1] (persistent
  buffers: in the files, not parameters in diffusers);
- `face_encoder.{conv1_local,conv2,conv3}.conv.{weight,bias}`, `face_encoder.out_proj.*`, `face_encoder.padding_tokens`;
- `face_adapter.fuser_blocks.N.{linear1_kv, linear1_q, linear2, q_norm, k_norm}`: `linear1_kv` holds key and value
  stacked (diffusers' `to_k` / `to_v`), as diffusers' `convert_wan_transformer_to_diffusers` splits it.
Official Animate-2 names: diffusers' `convert_wan_animate_2_transformer_to_diffusers` (diffusers 0.42): the Wan
names with every block wrapped (`blocks.N.block.X`), attention projections `q k v o k_img v_img norm_k_img`;
diffusers keeps every other name (`modulation`, `norm3`, `head.head`, `img_emb.proj`, `text_embedding`).

The recogniser uses `official_to_diffusers`; `diffusers_to_official` writes the official layout (tests, converters).
"""
import re
from collections.abc import Callable

import torch

from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo
from modules.util.lora.keys import animate_2_to_diffusers, animate_2_to_original

ANIMATE_CLASS = "WanAnimateTransformer3DModel"
ANIMATE_2_CLASS = "WanAnimate2Transformer3DModel"
# diffusers' single-file detection key for Animate (single_file_utils CHECKPOINT_KEY_NAMES["wan_animate"])
OFFICIAL_ANIMATE_MARKER = "motion_encoder.dec.direction.weight"
DIFFUSERS_ANIMATE_MARKER = "motion_encoder.motion_synthesis_weight"
OFFICIAL_ANIMATE_2_MARKER = "blocks.0.block.self_attn.q.weight"
DIFFUSERS_ANIMATE_2_MARKER = "blocks.0.self_attn.to_q.weight"
BLUR_KERNEL = (1.0, 3.0, 3.0, 1.0)   # motion_encoder.py ResBlock / diffusers MotionEncoderResBlock default
FACE_ADAPTER_EVERY = 5               # model_animate.py: FaceAdapter(num_adapter_layers=num_layers // 5)

_ME = "motion_encoder.enc.net_app.convs."
# (official pattern, diffusers template); {K} a residual block (official K = diffusers K - 1), {N} any index
_ANIMATE_RULES: tuple[tuple[str, str], ...] = (
    ("pose_patch_embedding", "pose_patch_embedding"),
    (_ME + "0.0.weight", "motion_encoder.conv_in.weight"),
    (_ME + "0.1.bias", "motion_encoder.conv_in.act_fn.bias"),
    (_ME + "{K}.conv1.0.weight", "motion_encoder.res_blocks.{K}.conv1.weight"),
    (_ME + "{K}.conv1.1.bias", "motion_encoder.res_blocks.{K}.conv1.act_fn.bias"),
    (_ME + "{K}.conv2.0.kernel", "motion_encoder.res_blocks.{K}.conv2.blur_kernel"),
    (_ME + "{K}.conv2.1.weight", "motion_encoder.res_blocks.{K}.conv2.weight"),
    (_ME + "{K}.conv2.2.bias", "motion_encoder.res_blocks.{K}.conv2.act_fn.bias"),
    (_ME + "{K}.skip.0.kernel", "motion_encoder.res_blocks.{K}.conv_skip.blur_kernel"),
    (_ME + "{K}.skip.1.weight", "motion_encoder.res_blocks.{K}.conv_skip.weight"),
    (_ME + "{K}.weight", "motion_encoder.conv_out.weight"),
    ("motion_encoder.enc.fc.{N}", "motion_encoder.motion_network.{N}"),
    ("motion_encoder.dec.direction.weight", "motion_encoder.motion_synthesis_weight"),
    ("face_encoder.conv1_local.conv", "face_encoder.conv1_local"),
    ("face_encoder.conv2.conv", "face_encoder.conv2"),
    ("face_encoder.conv3.conv", "face_encoder.conv3"),
    ("face_encoder.out_proj", "face_encoder.out_proj"),
    ("face_encoder.padding_tokens", "face_encoder.padding_tokens"),
    ("face_adapter.fuser_blocks.{N}.linear1_q", "face_adapter.{N}.to_q"),
    ("face_adapter.fuser_blocks.{N}.linear1_kv", "face_adapter.{N}.linear1_kv"),   # split into to_k / to_v below
    ("face_adapter.fuser_blocks.{N}.linear2", "face_adapter.{N}.to_out"),
    ("face_adapter.fuser_blocks.{N}.q_norm", "face_adapter.{N}.norm_q"),
    ("face_adapter.fuser_blocks.{N}.k_norm", "face_adapter.{N}.norm_k"),
)


def _compile(template: str) -> re.Pattern[str]:
    body = re.escape(template).replace(re.escape("{K}"), r"(?P<K>\d+)").replace(re.escape("{N}"), r"(?P<N>\d+)")
    return re.compile(rf"^{body}(?P<rest>\..+)?$")


_TO_DIFFUSERS = tuple((_compile(official), diffusers) for official, diffusers in _ANIMATE_RULES)
_TO_OFFICIAL = tuple((_compile(diffusers), official) for official, diffusers in _ANIMATE_RULES)


def _apply(name: str, rules, k_shift: int) -> str | None:
    for pattern, target in rules:
        match = pattern.match(name)
        if match is None:
            continue
        groups = match.groupdict()
        if groups.get("K") is not None:
            target = target.replace("{K}", str(int(groups["K"]) + k_shift))
        if groups.get("N") is not None:
            target = target.replace("{N}", groups["N"])
        return target + (groups.get("rest") or "")
    return None


def is_official_animate(names) -> bool:
    return OFFICIAL_ANIMATE_MARKER in names


def is_official_animate_2(names) -> bool:
    return OFFICIAL_ANIMATE_2_MARKER in names


def is_diffusers_animate_2(names) -> bool:
    return DIFFUSERS_ANIMATE_2_MARKER in names and "head.head.weight" in names


def animate_name_to_diffusers(name: str) -> str | None:
    """An official Animate-only name (motion / face encoders, face adapter, pose embedding) in diffusers' names, or
    None for the names every Wan model has (modules/util/lora/keys.py maps those)."""
    if name.startswith(_ME) and re.match(r"^\d+\.weight$", name[len(_ME):]):
        return "motion_encoder.conv_out.weight"   # the last conv: a bare EqualConv2d, whatever its index
    return _apply(name, _TO_DIFFUSERS, k_shift=-1)


def animate_2_name_to_diffusers(name: str) -> str:
    """`blocks.N.block.self_attn.q.weight` -> `blocks.N.self_attn.to_q.weight`; other names are kept."""
    return animate_2_to_diffusers(name)


def _half(which: int) -> Callable[[torch.Tensor, object], torch.Tensor]:
    def take(tensor: torch.Tensor, _tensors) -> torch.Tensor:
        return tensor.chunk(2, dim=0)[which]
    return take


def _flat(tensor: torch.Tensor, _tensors) -> torch.Tensor:
    return tensor.reshape(-1)


def adapt_official_animate(names: dict[str, str], shapes: dict[str, TensorInfo], scales: dict[str, str]
                           ) -> tuple[dict[str, Callable], dict[str, str]]:
    """Turns the renamed official entries into what diffusers' model holds, in place: `linear1_kv` into `to_k` and
    `to_v` (first and second half of its rows, its scale shared), the (1, C, 1, 1) activation biases into (C,), and
    the blur kernels out of the state (they are buffers diffusers computes; `check_blur_kernels` compares them at
    load). Returns (name -> take applied to the file's tensor, blur kernel name -> key in the file)."""
    takes: dict[str, Callable] = {}
    kernels: dict[str, str] = {}
    for name in [n for n in names if ".linear1_kv." in n]:
        key, info = names.pop(name), shapes.pop(name)
        for which, projection in enumerate(("to_k", "to_v")):
            new = name.replace(".linear1_kv.", f".{projection}.")
            names[new], takes[new] = key, _half(which)
            shapes[new] = TensorInfo((info.shape[0] // 2, *info.shape[1:]), info.dtype)
    for module in [m for m in scales if m.endswith(".linear1_kv")]:
        key = scales.pop(module)
        for projection in ("to_k", "to_v"):
            scales[module.removesuffix("linear1_kv") + projection] = key
    for name in [n for n in names if n.startswith("motion_encoder.") and n.endswith(".act_fn.bias")]:
        info = shapes[name]
        if len(info.shape) == 4:
            takes[name] = _flat
            shapes[name] = TensorInfo((info.shape[1],), info.dtype)
    for name in [n for n in names if n.endswith(".blur_kernel")]:
        kernels[name] = names.pop(name)
        shapes.pop(name)
    return takes, kernels


def check_blur_kernels(model: torch.nn.Module, kernels: dict[str, str], tensors, source: str) -> None:
    """The file's blur kernels are the filter diffusers builds (a different one would change the motion code)."""
    buffers = dict(model.named_buffers())
    wrong = [key for name, key in kernels.items() if name not in buffers
             or not torch.allclose(tensors[key].float(), buffers[name].float(), atol=1e-6)]
    if wrong:
        raise ModelFileError(f"{source}: the motion encoder's blur kernels {wrong[:3]} are not the [1, 3, 3, 1] "
                             f"filter of Wan2.2-Animate; not a Wan-Animate motion encoder this project reads")


def animate_config_fields(keys: dict[str, TensorInfo], num_layers: int, source: str) -> dict:
    """The `WanAnimateTransformer3DModel` fields the diffusers-named shapes imply (motion and face encoders, face
    adapter count); none of them is a head count, so every one is read from a shape."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise ModelFileError(f"{source}: no tensor {name!r}; not a complete Wan-Animate transformer")
        return keys[name].shape

    res_blocks = 1 + max((int(m.group(1)) for k in keys
                          if (m := re.match(r"^motion_encoder\.res_blocks\.(\d+)\.", k))), default=-1)
    size = 2 ** (res_blocks + 2)   # each residual block halves the side; conv_out's 4x4 kernel takes the last 4
    channels = {str(size): shape("motion_encoder.conv_in.weight")[0]}
    for index in range(res_blocks):
        channels[str(size // 2 ** (index + 1))] = shape(f"motion_encoder.res_blocks.{index}.conv2.weight")[0]
    adapters = 1 + max((int(m.group(1)) for k in keys if (m := re.match(r"^face_adapter\.(\d+)\.", k))), default=-1)
    if adapters != num_layers // FACE_ADAPTER_EVERY:
        raise ModelFileError(f"{source}: {adapters} face adapter blocks for {num_layers} transformer blocks; "
                             f"Wan2.2-Animate has one every {FACE_ADAPTER_EVERY} blocks ({num_layers // 5})")
    from diffusers.models.transformers.transformer_wan_animate import WAN_ANIMATE_MOTION_ENCODER_CHANNEL_SIZES
    if all(WAN_ANIMATE_MOTION_ENCODER_CHANNEL_SIZES.get(side) == width for side, width in channels.items()):
        channels = None   # the release's widths: its config.json leaves them to the class default
    conv1 = shape("face_encoder.conv1_local.weight")
    hidden = shape("face_encoder.conv2.weight")[0]
    return dict(
        _class_name=ANIMATE_CLASS,
        latent_channels=shape("pose_patch_embedding.weight")[1],
        motion_encoder_size=size,
        motion_encoder_channel_sizes=channels,
        motion_style_dim=shape("motion_encoder.conv_out.weight")[0],
        motion_dim=shape("motion_encoder.motion_synthesis_weight")[1],
        motion_encoder_dim=shape("motion_encoder.motion_synthesis_weight")[0],
        face_encoder_hidden_dim=hidden,
        face_encoder_num_heads=conv1[0] // hidden,
        inject_face_latents_blocks=FACE_ADAPTER_EVERY,
        motion_encoder_batch_size=8,   # face frames per motion-encoder call: memory, not weights (the release's)
    )


def animate_2_config(keys: dict[str, TensorInfo], source: str, given: dict | None) -> dict:
    """A `WanAnimate2Transformer3DModel` config from diffusers-named shapes; the head count (in no shape) from
    `given` (its config.json or the base's) or the released width's 128-wide heads."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise ModelFileError(f"{source}: no tensor {name!r}; not a complete Wan-Animate-2 transformer")
        return keys[name].shape

    patch = shape("patch_embedding.weight")
    dim = patch[0]
    given = given or {}
    heads = given.get("num_heads") or given.get("num_attention_heads")
    if not heads:
        if dim % 128:
            raise ModelFileError(f"{source}: a transformer {dim} wide is not a released Wan size; its head count is "
                                 f"in no tensor shape: put its config.json beside the file")
        heads = dim // 128
    # the reference's RoPE placement is in no shape: a given Animate-2 config's, else the release's (the defaults)
    config = dict(text_len=512, eps=1e-6, refer_offset_t=1, refer_offset_h=0, refer_offset_w=-1, refer_stride=1)
    config.update({k: given[k] for k in config if k in given})
    config.update(
        _class_name=ANIMATE_2_CLASS, patch_size=list(patch[2:]), in_dim=patch[1], dim=dim,
        ffn_dim=shape("blocks.0.ffn.0.weight")[0], freq_dim=shape("time_embedding.0.weight")[1],
        text_dim=shape("text_embedding.0.weight")[1],
        out_dim=shape("head.head.weight")[0] // (patch[2] * patch[3] * patch[4]), num_heads=heads,
        num_layers=1 + max(int(k.split(".")[1]) for k in keys if k.startswith("blocks.")),
        use_img_emb="img_emb.proj.1.weight" in keys, cross_attn_norm="blocks.0.norm3.weight" in keys)
    return config


# --- the other way: diffusers -> official (fixture writers, converters) ---------------------------------------

def diffusers_to_official(state: dict[str, torch.Tensor], animate_2: bool = False) -> dict[str, torch.Tensor]:
    """A diffusers Animate (or Animate-2) state dict in the official names, with the official layout's extra
    tensors (stacked `linear1_kv`, (1, C, 1, 1) biases, the blur kernels)."""
    if animate_2:
        return {animate_2_to_original(name): value for name, value in state.items()}
    from modules.util.lora.keys import diffusers_to_original_state_dict
    common = {k: v for k, v in state.items() if not k.startswith(("motion_encoder.", "face_encoder.",
                                                                  "face_adapter.", "pose_patch_embedding."))}
    out = diffusers_to_original_state_dict(common)
    res_blocks = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("motion_encoder.res_blocks."))
    kernel = torch.tensor(BLUR_KERNEL)
    kernel = kernel[None, :] * kernel[:, None]
    kernel = kernel / kernel.sum()
    for name, value in state.items():
        if name in common:
            continue
        if name == "motion_encoder.conv_out.weight":
            out[f"{_ME}{res_blocks + 1}.weight"] = value
            continue
        if ".to_k." in name and name.startswith("face_adapter."):
            out[_apply(name.replace(".to_k.", ".linear1_kv."), _TO_OFFICIAL, 1)] = torch.cat(
                [value, state[name.replace(".to_k.", ".to_v.")]])
            continue
        if ".to_v." in name and name.startswith("face_adapter."):
            continue
        official = _apply(name, _TO_OFFICIAL, k_shift=1)
        if official is None:
            raise KeyError(f"diffusers Wan-Animate key {name!r} has no official name")
        out[official] = value.reshape(1, -1, 1, 1) if name.endswith(".act_fn.bias") else value
    for index in range(1, res_blocks + 1):
        out[f"{_ME}{index}.conv2.0.kernel"] = kernel.clone()
        out[f"{_ME}{index}.skip.0.kernel"] = kernel.clone()
    return out
