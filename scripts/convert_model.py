"""Converts a Wan model between a diffusers folder and an original-format single-file transformer.

  convert_model.py --input-name DIR --output-model-format ORIGINAL --output-model-destination out.safetensors
  convert_model.py --input-name file.safetensors --base-model-name DIR --output-model-format DIFFUSERS \
      --output-model-destination out_dir
"""
import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401

from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-name", required=True,
                        help="a diffusers folder, a hub id (with --allow-download), or an original-format "
                             "transformer .safetensors file (then --base-model-name gives the other parts)")
    parser.add_argument("--base-model-name", default="", help="diffusers folder with the parts a single file lacks")
    parser.add_argument("--output-model-format", required=True, choices=[f.value for f in ModelFormat])
    parser.add_argument("--output-model-destination", required=True)
    parser.add_argument("--output-dtype", choices=[d.value for d in DataType], default=None,
                        help="cast the written weights; default: keep each tensor's dtype")
    parser.add_argument("--allow-download", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
    from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    from modules.util.wan_detection import NotAWanModelError

    input_path = Path(args.input_name)
    if input_path.suffix == ".safetensors":
        if not args.base_model_name:
            print("convert_model: --input-name is a single transformer file; --base-model-name must name the "
                  "diffusers folder that provides the config and the other parts", file=sys.stderr)
            return 2
        config = ModelConfig(base_model_name=args.base_model_name, allow_download=args.allow_download,
                             transformer=PartConfig(path=str(input_path)))
    else:
        config = ModelConfig(base_model_name=args.input_name, allow_download=args.allow_download)
    # load in float32 unless told otherwise, so no precision is lost on the way through
    dtype = DataType(args.output_dtype) if args.output_dtype else None
    try:
        model = WanBaseModelLoader().load(config)
        written = WanBaseModelSaver().save(model, ModelFormat(args.output_model_format),
                                           args.output_model_destination, dtype.torch_dtype() if dtype else None)
    except (ModelLoadError, NotAWanModelError, ValueError, OSError) as e:
        print(f"convert_model: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
