"""Converts a Wan model between a diffusers folder and an original-format single-file transformer, converts LoRA
files between formats, and merges LoRA files into a base model.

Base model (DIR: a diffusers folder, an official Wan release folder or a folder of ComfyUI single files; convert it
once to a diffusers folder, or to an ORIGINAL / ORIGINAL_FP8_SCALED single file):
  convert_model.py --input-name DIR --output-model-format ORIGINAL --output-model-destination out.safetensors
  convert_model.py --input-name file.safetensors --base-model-name DIR --output-model-format DIFFUSERS \\
      --output-model-destination out_dir
LoRA file (reads every layout the trainer reads; A14B: x_high_noise / x_low_noise, or x whose pair exists, convert
both into the destination's _high_noise / _low_noise names; the input's metadata is kept):
  convert_model.py --training-method LORA --input-name lora.safetensors \\
      --output-model-format {COMFY_LORA,KOHYA_LORA,DIFFUSERS_LORA} --output-model-destination out.safetensors
Merge LoRA files (PATH[:STRENGTH], repeatable; A14B: _high_noise into transformer, _low_noise into transformer_2):
  convert_model.py --merge-lora lora.safetensors:0.8 --base-model-name DIR --output-model-format DIFFUSERS \\
      --output-model-destination merged_dir [--output-dtype BFLOAT_16]
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
import torch

from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.TrainingMethod import TrainingMethod


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-name", default="",
                        help="a diffusers folder, a hub id (with --allow-download), or an original-format "
                             "transformer .safetensors file (then --base-model-name gives the other parts); "
                             "with --training-method LORA: the LoRA file")
    parser.add_argument("--base-model-name", default="",
                        help="diffusers folder with the parts a single file lacks; with --merge-lora and no "
                             "--input-name: the model to merge into")
    parser.add_argument("--training-method", choices=[m.value for m in TrainingMethod], default=None,
                        help="LORA: --input-name is a LoRA file to convert (implied by a *_LORA output format)")
    parser.add_argument("--merge-lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                        help="merge this LoRA file into the base model (repeatable; strength 1 by default)")
    parser.add_argument("--output-model-format", required=True, choices=[f.value for f in ModelFormat])
    parser.add_argument("--output-model-destination", required=True)
    parser.add_argument("--output-dtype", choices=[d.value for d in DataType], default=None,
                        help="cast the written weights; default: keep each tensor's dtype. FLOAT_8 (ORIGINAL "
                             "only): weight matrices in float8_e4m3fn, the rest in bfloat16, as ComfyUI's fp8 files")
    parser.add_argument("--allow-download", action="store_true")
    return parser.parse_args(argv)


def convert_lora(args: argparse.Namespace, output_format: ModelFormat, dtype) -> int:
    from modules.util.lora.convert import LoraConvertError, convert_lora_files
    from modules.util.lora.formats import LoraMatchError

    if not output_format.is_lora:
        print(f"convert_model: --training-method LORA writes COMFY_LORA, KOHYA_LORA or DIFFUSERS_LORA, not "
              f"{output_format}", file=sys.stderr)
        return 2
    if not args.input_name:
        print("convert_model: --input-name must name the LoRA file to convert", file=sys.stderr)
        return 2
    try:
        done = convert_lora_files(args.input_name, args.output_model_destination, output_format, dtype)
    except (LoraConvertError, LoraMatchError, ValueError, OSError) as e:
        print(f"convert_model: {e}", file=sys.stderr)
        return 1
    for source, target, layout in done:
        print(f"{target}  (from {source}, {layout})", file=sys.stderr)
        print(target)
    return 0


# float8 files are read as before (FLOAT_32): their float8 tensors stay float8, the scaled ones dequantise exactly
_AS_STORED = {"fp32": DataType.FLOAT_32, "bf16": DataType.BFLOAT_16, "fp16": DataType.FLOAT_16}


def _stored_parts(config) -> dict:
    """Each part's FoundPart in the files the loader reads (the base folder, then the parts named apart)."""
    from modules.modelLoader.wan.parts.recognise import find_parts
    from modules.modelLoader.wan.parts.tensor_files import ModelFileError
    sources = [Path(config.base_model_name)] + [Path(getattr(config, name).path) for name in
                                                 ("transformer", "transformer_2", "vae", "text_encoder")
                                                 if getattr(config, name).path]
    parts = {}
    for source in sources:
        if not source.exists():
            continue   # a hub id: loaded as before, in float32
        try:
            found = find_parts(source)
        except ModelFileError:
            continue   # the loader names the problem
        for part in found:
            name = part.role or part.part
            if name in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder"):
                parts[name] = part
    return parts


def keep_stored_dtypes(config, parts: dict):
    """`config` with each part loaded in the dtype its file mostly stores (no --output-dtype: the default keeps each
    tensor's dtype): a bf16 model is read and written in bf16, never widened to float32 (twice the memory and the
    file)."""
    return config.model_copy(update={
        name: getattr(config, name).model_copy(update={"weight_dtype": _AS_STORED[part.dtype]})
        for name, part in parts.items() if part.dtype in _AS_STORED})


def restore_stored_dtypes(model, parts: dict, dtype, written: tuple[str, ...]) -> None:
    """Without `dtype`: the tensors the loader widened (diffusers keeps its float32 modules in float32 whatever the
    file stores; a merge reads the transformer in float32) back to the file's dtype. With it: each tensor of the
    `written` parts cast to `dtype` as the saver casts, one at a time and in place (the model is not used again), so
    the model and its cast copy are never whole in memory together."""
    if dtype is not None:
        from modules.modelSaver.wan.WanBaseModelSaver import cast_in_place
        for name, module in model.parts().items():
            if name in written:
                cast_in_place(module, dtype)
        return
    for name, part in parts.items():
        module = getattr(model, name, None)
        stored = part.detail.shapes if part.part == "transformer" and part.detail is not None else part.keys or {}
        if module is None:
            continue
        for key, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            info = stored.get(key)
            if info is None or not tensor.is_floating_point() or info.dtype.startswith("float8"):
                continue
            dtype = getattr(torch, info.dtype)
            if dtype.is_floating_point and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    output_format = ModelFormat(args.output_model_format)
    dtype = DataType(args.output_dtype).storage_dtype() if args.output_dtype else None
    if dtype == torch.float8_e4m3fn and output_format is not ModelFormat.ORIGINAL:
        print(f"convert_model: --output-dtype FLOAT_8 writes float8_e4m3fn weights into an ORIGINAL single file "
              f"(ComfyUI loads it); {output_format} is not written in fp8 (diffusers cannot compute in float8, and "
              f"LoRA factors lose too much); use BFLOAT_16", file=sys.stderr)
        return 2
    method = TrainingMethod(args.training_method) if args.training_method else None
    if args.merge_lora and (method is TrainingMethod.LORA or output_format.is_lora):
        print("convert_model: --merge-lora writes a base model (DIFFUSERS or ORIGINAL); to convert a LoRA file "
              "use --training-method LORA without --merge-lora", file=sys.stderr)
        return 2
    if method is TrainingMethod.LORA or output_format.is_lora:
        return convert_lora(args, output_format, dtype)
    if method not in (None, TrainingMethod.FINE_TUNE):
        print(f"convert_model: nothing to convert for --training-method {method}", file=sys.stderr)
        return 2

    from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
    from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
    from modules.modelSampler.sampling_io import apply_lora_files, parse_lora_argument
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    from modules.util.lora.formats import LoraMatchError
    from modules.util.wan_detection import NotAWanModelError

    model_name = args.input_name or (args.base_model_name if args.merge_lora else "")
    if not model_name:
        print("convert_model: --input-name must name the model to convert (or, with --merge-lora, "
              "--base-model-name the model to merge into)", file=sys.stderr)
        return 2
    input_path = Path(model_name)
    if input_path.is_file() or input_path.suffix == ".safetensors":
        if not args.base_model_name:
            print("convert_model: --input-name is a single transformer file; --base-model-name must name the "
                  "folder (diffusers, official Wan release or ComfyUI files) that provides the other parts",
                  file=sys.stderr)
            return 2
        config = ModelConfig(base_model_name=args.base_model_name, allow_download=args.allow_download,
                             transformer=PartConfig(path=str(input_path)))
    else:
        config = ModelConfig(base_model_name=model_name, allow_download=args.allow_download)
    parts = _stored_parts(config)
    # a merge adds its deltas in float32 into float32 weights, rounding once at the end, as before
    config = keep_stored_dtypes(config, {name: part for name, part in parts.items()
                                         if not (args.merge_lora and name.startswith("transformer"))})
    try:
        model = WanBaseModelLoader().load(config)
        if args.merge_lora:
            # A14B: `_high_noise` files into `transformer`, `_low_noise` into `transformer_2`, as the sampler does
            loras = [(Path(path), float(strength)) for path, strength in map(parse_lora_argument, args.merge_lora)]
            for line in apply_lora_files(model, loras):
                print(f"merged {line}", file=sys.stderr)
        # an ORIGINAL file holds the transformers only
        written_parts = tuple(model.parts()) if output_format is ModelFormat.DIFFUSERS \
            else ("transformer", "transformer_2")
        restore_stored_dtypes(model, parts, dtype, written_parts)
        written = WanBaseModelSaver().save(model, output_format, args.output_model_destination, dtype)
    except (ModelLoadError, NotAWanModelError, LoraMatchError, ValueError, OSError) as e:
        print(f"convert_model: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
