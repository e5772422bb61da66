"""Peak memory while loading a real-size transformer from each file layout (the target: loading costs one copy).

The transformer of a released variant (resources/wan_configs) is built on the meta device and written tensor by
tensor (zeros: the loader's memory does not depend on the values) as
- `diffusers`: a diffusers `transformer/` folder (config.json + diffusion_pytorch_model.safetensors), bf16, read by
  diffusers' from_pretrained;
- `original_bf16`: one ComfyUI-style file with the official Wan names under `model.diffusion_model.`, bf16;
- `fp8_scaled`: the same as ComfyUI's `*_fp8_scaled.safetensors` (float8 block Linear weights + `scale_weight`, the
  `scaled_fp8` marker, the rest bf16);
- `original_bf16_as_fp8`: the bf16 file loaded with FLOAT_8 weights (cast to float8 as read);
- `original_fp16_as_bf16`: the file in fp16 (as ComfyUI's `*_fp16.safetensors`) loaded as BFLOAT_16 (cast as read);
then each is loaded in a fresh process, which reports its peak resident set (ru_maxrss) before the load and after
it, with every weight page touched (resident, as in training).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from modules.benchmark.common import GIB, run_in_fresh_process

LAYOUTS = ("diffusers", "original_bf16", "fp8_scaled", "original_bf16_as_fp8", "original_fp16_as_bf16")
_SAFETENSORS_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.float8_e4m3fn: "F8_E4M3"}
_CHUNK = 64 * 1024 * 1024


def _meta_state(release: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from modules.util.empty_weights import empty_weights
    from diffusers import WanTransformer3DModel

    from modules.modelLoader.wan.parts.wan_configs import released_configs
    config = released_configs()[release]["transformer"]
    with empty_weights():
        model = WanTransformer3DModel.from_config(config)
    return config, model.state_dict()


def write_streaming_safetensors(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                                metadata: dict[str, str] | None = None) -> int:
    """A safetensors file of zeros from (shape, dtype) alone, written in chunks: the writer never holds a whole
    model. Returns the file size."""
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for key, (shape, dtype) in specs.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    zeros = bytes(_CHUNK)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        remaining = offset
        while remaining:
            count = min(remaining, _CHUNK)
            file.write(zeros[:count])
            remaining -= count
    return path.stat().st_size


def write_layout(layout: str, folder: Path, release: str) -> Path:
    from modules.util.lora.keys import diffusers_to_original_state_dict
    config, meta = _meta_state(release)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "diffusers":
        target = folder / "transformer"
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text(json.dumps(config))
        write_streaming_safetensors(target / "diffusion_pytorch_model.safetensors",
                                    {k: (tuple(v.shape), torch.bfloat16) for k, v in meta.items()})
        return target
    original = diffusers_to_original_state_dict(meta, prefix="model.diffusion_model.")
    stored = torch.float16 if layout == "original_fp16_as_bf16" else torch.bfloat16
    layout = {"original_bf16_as_fp8": "original_bf16", "original_fp16_as_bf16": "original_fp16"}.get(layout, layout)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, value in original.items():
        name = key.removeprefix("model.diffusion_model.")
        if layout == "fp8_scaled" and name.startswith("blocks.") and key.endswith(".weight") and value.dim() == 2:
            specs[key] = (tuple(value.shape), torch.float8_e4m3fn)
            specs[key.removesuffix(".weight") + ".scale_weight"] = ((), torch.float32)
        else:
            specs[key] = (tuple(value.shape), stored)
    if layout == "fp8_scaled":
        specs["model.diffusion_model.scaled_fp8"] = ((0,), torch.float8_e4m3fn)
    path = folder / f"{release}_{layout}.safetensors"
    write_streaming_safetensors(path, specs)
    return path


def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def measure_in_this_process(layout: str, path: Path, weight_dtype: str) -> dict:
    """Imports first (their memory is the baseline), then loads the transformer and reports the peaks."""
    from diffusers import WanTransformer3DModel

    from modules.modelLoader.wan.parts.recognise import find_parts
    from modules.modelLoader.wan.parts.transformer_files import load_transformer
    from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
    from modules.util.enum.DataType import DataType
    import time
    dtype = DataType(weight_dtype)
    baseline = _peak_rss_bytes()
    start = time.perf_counter()
    if layout == "diffusers":
        model = WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype.torch_dtype())
    else:
        [found] = find_parts(path)
        config = transformer_config_from_shapes(found.detail.shapes, str(path))
        model = load_transformer(found.files, found.detail, config, dtype, str(path))
    seconds = time.perf_counter() - start
    # a model that trains has every weight resident: touch one byte per page (diffusers keeps its tensors
    # memory-mapped and unread until first use, which would hide their size)
    for tensor in model.state_dict().values():
        if tensor.numel():
            tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum()
    peak = _peak_rss_bytes()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "weights_bytes": weights, "seconds": seconds}


def run_load_benchmark(workdir: Path, release: str = "wan2.1-t2v-1.3b", layouts=LAYOUTS, keep_files: bool = False,
                       log=print) -> list[dict]:
    rows = []
    for layout in layouts:
        path = write_layout(layout, workdir, release)
        weight_file = path / "diffusion_pytorch_model.safetensors" if path.is_dir() else path
        size = weight_file.stat().st_size
        weight_dtype = "FLOAT_8" if layout in ("fp8_scaled", "original_bf16_as_fp8") else "BFLOAT_16"
        log(f"{layout}: wrote {size / GIB:.2f} GiB to {path}; loading in a fresh process ({weight_dtype})")
        call = f"measure_in_this_process({layout!r}, Path({str(path)!r}), {weight_dtype!r})"
        measured = run_in_fresh_process("modules.benchmark.load_bench", call, f"loading {layout}")
        growth = measured["peak_rss_bytes"] - measured["baseline_rss_bytes"]
        rows.append({"layout": layout, "file_gib": size / GIB, "weights_gib": measured["weights_bytes"] / GIB,
                     "baseline_rss_gib": measured["baseline_rss_bytes"] / GIB,
                     "peak_rss_gib": measured["peak_rss_bytes"] / GIB, "load_growth_gib": growth / GIB,
                     "growth_over_file": growth / size, "peak_over_file": measured["peak_rss_bytes"] / size,
                     "seconds": measured["seconds"]})
        if not keep_files:
            weight_file.unlink()
    return rows
