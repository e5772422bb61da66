"""The UMT5-XXL text encoder in the layouts users hold it, loaded into transformers' `UMT5EncoderModel`.

Layouts (recognised by tensor names and shapes):
- "wan": the official `models_t5_umt5-xxl-enc-bf16.pth`, a state dict of the `T5Encoder` of the official Wan
  repository's `wan/modules/t5.py` (Wan-Video/Wan2.1): `token_embedding`, `blocks.N.{norm1, attn.{q,k,v,o}, norm2,
  ffn.{gate.0, fc1, fc2}, pos_embedding.embedding}`, `norm`. `umt5_xxl()` there builds it with `shared_pos=False`: a
  relative position embedding in every block, as transformers' UMT5 has. Its feed-forward is `fc2(fc1(x) *
  gelu_tanh(gate.0(x)))`, i.e. transformers' gated-gelu `wo(wi_1(x) * gelu_new(wi_0(x)))`.
- "comfyui": transformers' own names (`shared.weight`, `encoder.block.N.layer.0.SelfAttention.q.weight`, ...), as
  ComfyUI's `umt5_xxl_fp16.safetensors` / `umt5_xxl_fp8_e4m3fn_scaled.safetensors` hold them (comfy/text_encoders/t5.py
  uses the same module names), also with the `encoder.` prefix dropped from the stack's keys or under an outer prefix
  (a checkpoint bundling several models: ComfyUI's save_checkpoint puts it under `text_encoders.umt5xxl.transformer.`),
  and with the `logit_scale` that ComfyUI's CLIPSave writes beside it (ignored). fp8_scaled files store Linear
  weights in float8 with a float32 scale beside each (weight = fp8 * scale) in either of ComfyUI's namings
  (comfy_quant.py: legacy `scale_weight` / `scale_input` / `scaled_fp8`, current `weight_scale` / `input_scale` /
  `comfy_quant`); a `spiece_model` uint8 tensor may carry the tokenizer (read by tokenizer_files.py). A diffusers
  folder's `text_encoder/` has these names too and is loaded with `from_pretrained` by the parts loader.

A plain T5 (v1.1) encoder, with a relative position embedding only in block 0, is not UMT5 and is not recognised.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import UMT5Config, UMT5EncoderModel

from modules.modelLoader.wan.parts.state_reads import TensorRead, read_state
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo, open_tensors, read_keys_and_shapes
from modules.modelLoader.wan.parts import comfy_quant
from modules.util.empty_weights import empty_weights
from modules.util.encoder_keys import SPIECE_MODEL_KEY, WAN_T5_BLOCK_NAMES, WAN_T5_TOP_NAMES
from modules.util.fp8_scaled import make_scaled_fp8

LAYOUT_WAN = "wan"
LAYOUT_COMFYUI = "comfyui"
CONFIG_PATH = Path(__file__).resolve().parents[4] / "resources" / "wan_configs" / "encoders" / "umt5-xxl.json"

_HF_ANCHOR = re.compile(r"^(?P<outer>.*?)(?P<stack>encoder\.)?block\.0\.layer\.0\.SelfAttention\.q\.weight$")
_WAN_ANCHOR = re.compile(r"^(?P<outer>.*?)blocks\.0\.attn\.q\.weight$")
_STACK_PARTS = ("block.", "final_layer_norm.", "embed_tokens.")
# a full encoder-decoder checkpoint: the decoder and LM head are not the text encoder's
_OTHER_HALF = ("decoder.", "lm_head.")
# ComfyUI's SDClipModel (comfy/sd1_clip.py) holds a `logit_scale` parameter beside its `transformer`; CLIPSave
# (comfy_extras/nodes_model_merging.py) strips the `umt5xxl.` and `transformer.` prefixes and keeps it
COMFY_LOGIT_SCALE = "logit_scale"


@dataclass(frozen=True)
class TextEncoderKeys:
    layout: str
    names: dict[str, str]     # transformers name -> key in the file
    scales: dict[str, str]    # transformers weight name -> key of its scale_weight / weight_scale (fp8_scaled)


def _wan_names(keys: dict[str, TensorInfo]) -> TextEncoderKeys | None:
    anchor = next((m for key in keys if (m := _WAN_ANCHOR.match(key))), None)
    if anchor is None or f"{anchor['outer']}token_embedding.weight" not in keys:
        return None
    outer = anchor["outer"]
    names: dict[str, str] = {}
    for key in keys:
        if not key.startswith(outer):
            continue
        rest = key[len(outer):]
        if rest in WAN_T5_TOP_NAMES:
            names[WAN_T5_TOP_NAMES[rest]] = key
        elif match := re.match(r"^blocks\.(\d+)\.(.+)$", rest):
            # an unknown block name is kept as it is: the key check reports it by the name the user sees
            names[f"encoder.block.{match[1]}.{WAN_T5_BLOCK_NAMES.get(match[2], match[2])}"] = key
        else:
            names[rest] = key
    return TextEncoderKeys(LAYOUT_WAN, names, {})


def _hf_names(keys: dict[str, TensorInfo]) -> TextEncoderKeys | None:
    anchor = next((m for key in keys if (m := _HF_ANCHOR.match(key))), None)
    if anchor is None:
        return None
    outer, stack = anchor["outer"], anchor["outer"] + (anchor["stack"] or "")
    names: dict[str, str] = {}
    scales: dict[str, str] = {}
    for key in keys:
        if not key.startswith(outer):
            continue   # another model bundled in the same file
        rest = key[len(outer):]
        if rest in (SPIECE_MODEL_KEY, COMFY_LOGIT_SCALE) or comfy_quant.is_quant_metadata_key(rest) \
                or rest.endswith(comfy_quant.BLOCK_SCALE_SUFFIX) or rest.startswith(_OTHER_HALF):
            continue
        if key.startswith(stack) and key[len(stack):].startswith(_STACK_PARTS):
            name = "encoder." + key[len(stack):]
        else:
            name = rest
        if (module := comfy_quant.scale_key_module(name)) is not None:
            scales[module + ".weight"] = key
        else:
            names[name] = key
    if "shared.weight" not in names and "encoder.embed_tokens.weight" in names:
        names["shared.weight"] = names.pop("encoder.embed_tokens.weight")
    names.pop("encoder.embed_tokens.weight", None)   # tied to shared.weight
    return TextEncoderKeys(LAYOUT_COMFYUI, names, scales)


def text_encoder_keys(keys: dict[str, TensorInfo]) -> TextEncoderKeys | None:
    """The file's keys by transformers' UMT5EncoderModel names, or None when the file is no UMT5 encoder."""
    found = _wan_names(keys) or _hf_names(keys)
    if found is None or "shared.weight" not in found.names:
        return None
    # UMT5 (not T5 v1.1): every block has its own relative position embedding
    bias = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    layers = _count_layers(found.names)
    if layers == 0 or any(bias.format(i) not in found.names for i in range(layers)):
        return None
    return found


def recognise_text_encoder(keys: dict[str, TensorInfo]) -> str | None:
    """"wan" (official T5 .pth names) or "comfyui" (transformers names, any dtype), or None: not a UMT5 encoder."""
    found = text_encoder_keys(keys)
    return found.layout if found is not None else None


def _count_layers(names: dict[str, str]) -> int:
    indices = {int(m[1]) for name in names if (m := re.match(r"^encoder\.block\.(\d+)\.", name))}
    return max(indices) + 1 if indices else 0


def text_encoder_config(shapes: dict[str, tuple[int, ...]], source: str) -> dict:
    """UMT5-XXL's config (resources/wan_configs/encoders/umt5-xxl.json) with every size read from the shapes, so the
    released encoder gets exactly its config and a smaller one (tests' tiny models) its own."""
    config = json.loads(CONFIG_PATH.read_text(encoding="utf-8"))

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ModelFileError(f"{source}: no tensor for the UMT5 encoder's {name}")
        return shapes[name]

    vocab, d_model = shape("shared.weight")
    inner = shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    buckets, heads = shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    if inner % heads:
        raise ModelFileError(f"{source}: attention width {inner} is not a multiple of the {heads} heads that the "
                             f"relative position embedding has")
    layers = _count_layers({name: "" for name in shapes})
    config.update(vocab_size=vocab, d_model=d_model, d_kv=inner // heads, num_heads=heads,
                  d_ff=shape("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")[0],
                  num_layers=layers, num_decoder_layers=layers, relative_attention_num_buckets=buckets)
    return config


def _dequantise(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.to(torch.float32)
    if scale.numel() == weight.shape[0] and scale.numel() > 1:
        scale = scale.reshape(-1, *([1] * (weight.dim() - 1)))   # one scale per output row
    elif scale.numel() != 1:
        raise ValueError(f"scale of shape {tuple(scale.shape)} fits neither a scalar nor {weight.shape[0]} rows")
    return weight.to(torch.float32) * scale


def shape_mismatch(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """What keeps `shapes` from filling a model whose state has `expected` shapes (counts and examples), or None."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [f"{name}: {tuple(shapes[name])} (expected {shape})" for name, shape in expected.items()
             if name in shapes and tuple(shapes[name]) != shape]
    if not (missing or unexpected or wrong):
        return None
    return (f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), "
            f"{len(wrong)} of the wrong shape (e.g. {wrong[:2]})")


def plan_text_encoder(keys: dict[str, TensorInfo], layout: str, source: str) -> tuple[TextEncoderKeys, UMT5Config]:
    """The file's names and the encoder's config, every tensor checked against a meta-built model: from the header
    alone, so a wrong file is reported before any weight is read."""
    found = text_encoder_keys(keys)
    if found is None or found.layout != layout:
        raise ModelFileError(f"{source}: not a UMT5 text encoder in the {layout!r} layout")
    problems = [problem for name, key in found.scales.items()
                if (problem := comfy_quant.layer_problem(name.removesuffix(".weight"),
                                                         keys.get(found.names.get(name, "")), keys[key]))]
    if problems:
        raise ModelFileError(comfy_quant.refusal(source, problems))
    shapes = {name: keys[key].shape for name, key in found.names.items()}
    config = UMT5Config(**text_encoder_config(shapes, source))
    with empty_weights():
        model = UMT5EncoderModel(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items() if name != "encoder.embed_tokens.weight"}
    problem = shape_mismatch(expected, shapes)
    if problem:
        raise ModelFileError(f"{source}: the tensors do not make a UMT5 encoder: {problem}")
    return found, config


def load_text_encoder(paths: list[Path], layout: str, dtype: torch.dtype, keep_fp8: bool = False
                      ) -> UMT5EncoderModel:
    """A UMT5EncoderModel in `dtype` from a file (or shard set) in `layout`, built on the meta device and filled one
    tensor at a time (state_reads.py: the weights exist once in memory).

    An fp8_scaled encoder is dequantised to `dtype` tensor by tensor by default: it is frozen, runs once per caption
    (or once for the whole cache) and is small beside the transformer. With `keep_fp8` (the text encoder's weight
    dtype is FLOAT_8) its scaled Linear layers stay float8 with their scales and dequantise per call
    (ScaledFp8Linear), half the memory; the feed-forward outputs `wo` are dequantised even then, because UMT5 casts
    their input to their weight's dtype.
    """
    keys = read_keys_and_shapes(paths)
    found, config = plan_text_encoder(keys, layout, str(paths[0]))
    with empty_weights():
        model = UMT5EncoderModel(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    # as from_pretrained does: the feed-forward output stays float32 when loading in float16 (T5's activations
    # overflow float16 there)
    keep_fp32 = set(UMT5EncoderModel._keep_in_fp32_modules or []) if dtype == torch.float16 else set()
    stays_fp8 = {name for name in found.scales if keep_fp8 and ".wo." not in name}
    reads = {}
    for name, key in found.names.items():
        scale = found.scales.get(name)
        if name in stays_fp8:
            reads[name] = TensorRead(key, shapes[name], getattr(torch, keys[key].dtype), keys[key].dtype)
            continue
        take = (lambda tensor, tensors, scale=scale: _dequantise(tensor, tensors[scale])) if scale else None
        target = torch.float32 if keep_fp32.intersection(name.split(".")) else dtype
        reads[name] = TensorRead(key, shapes[name], target, keys[key].dtype, take)
    with open_tensors(paths) as tensors:
        for name in stays_fp8:
            module = model.get_submodule(name.removesuffix(".weight"))
            make_scaled_fp8(module, tensors[found.scales[name]])
        state = read_state(tensors, reads)
    for name in stays_fp8:
        module_name = name.removesuffix(".weight")
        state[f"{module_name}.scale_weight"] = model.get_submodule(module_name).scale_weight
    state["encoder.embed_tokens.weight"] = state["shared.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.encoder.embed_tokens = model.shared   # tied, as from_pretrained leaves them
    return model.eval()
