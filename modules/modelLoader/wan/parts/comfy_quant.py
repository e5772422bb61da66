"""The names ComfyUI gives quantized Linear layers in the files it reads and writes (facts from ComfyUI's code, no
code of it), shared by the transformer and text-encoder readers.

Two generations of the same idea, weight = stored float8 * scale:
- legacy `scaled_fp8` files (the `*_fp8_scaled.safetensors` Comfy-Org released; comfy/ops.py `scaled_fp8_ops` in
  ComfyUI before the mixed-precision ops): `<layer>.weight` float8, `<layer>.scale_weight` float32, optional
  `<layer>.scale_input`, and one `scaled_fp8` marker tensor (under the file's key prefix);
- the current mixed-precision format (comfy/ops.py `mixed_precision_ops`, comfy/quant_ops.py `QUANT_ALGOS`): what
  ComfyUI writes when it saves a quantized model or text encoder (`MixedPrecisionOps.Linear.state_dict`) and what
  comfy/utils.py `convert_old_quants` turns a legacy file into: `<layer>.weight` float8, `<layer>.weight_scale`,
  optional `<layer>.input_scale`, and the layer's format as `<layer>.comfy_quant` (uint8 bytes of JSON such as
  `{"format": "float8_e4m3fn"}`) or, instead of those tensors, in the safetensors metadata
  `_quantization_metadata` (`{"format_version": "1.0", "layers": {"<layer>": {"format": ...}}}`).
Only the float8 formats (`float8_e4m3fn`, `float8_e5m2`: one float scale per tensor, or per output row) are read
here. The block-scaled and integer formats of the same scheme (`nvfp4`: uint8-packed weight, float8 block scales
`weight_scale` and `weight_scale_2`; `mxfp8`: float8 weight with uint8 block scales; `int8_tensorwise`) are refused
by their dtypes and shapes, naming the layer.
"""
from modules.modelLoader.wan.parts.tensor_files import TensorInfo

SCALED_FP8_MARKER = "scaled_fp8"
WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")   # legacy, current
# not needed to compute: input scales are for fp8 matrix multiplication (not done here), the format is checked by
# the weight's and scale's dtypes and shapes
IGNORED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
BLOCK_SCALE_SUFFIX = ".weight_scale_2"                       # nvfp4's second scale
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def scale_key_module(name: str) -> str | None:
    """`blocks.0.q` for `blocks.0.q.scale_weight` / `blocks.0.q.weight_scale`, else None."""
    for suffix in WEIGHT_SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


def is_quant_metadata_key(name: str) -> bool:
    """The marker, input scales and per-layer format tensors: read by no model."""
    return name == SCALED_FP8_MARKER or name.endswith(("." + SCALED_FP8_MARKER, *IGNORED_SUFFIXES))


def has_scales(keys) -> bool:
    return any(scale_key_module(key) is not None or is_quant_metadata_key(key) for key in keys)


def layer_problem(layer: str, weight: TensorInfo | None, scale: TensorInfo) -> str | None:
    """Why the quantized `layer` is not one this project reads, or None (float8 weight, float scale per tensor or per
    output row)."""
    if weight is None:
        return f"{layer}: a weight scale without a weight"
    if weight.dtype not in FLOAT8_DTYPES:
        return f"{layer}: weight stored as {weight.dtype} with a weight scale (ComfyUI's nvfp4 / int8 formats)"
    if scale.dtype.startswith("float8") or not scale.dtype.startswith(("float", "bfloat")):
        return f"{layer}: weight scale stored as {scale.dtype} (block scales: ComfyUI's mxfp8 format)"
    if scale.numel not in (1, weight.shape[0]):
        return f"{layer}: weight scale of shape {list(scale.shape)} for a {list(weight.shape)} weight (block scales)"
    return None


def refusal(source: str, problems: list[str]) -> str:
    return (f"{source}: quantized weights this project does not read ({len(problems)} layers, e.g. {problems[0]}): "
            f"only float8 weights with one float scale per tensor or per output row are read (ComfyUI's fp8_scaled "
            f"files and its float8_e4m3fn / float8_e5m2 layer formats); use the fp8_scaled, fp8_e4m3fn or bf16 file "
            f"of this model")
