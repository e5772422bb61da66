"""Peak memory while loading the real-size text and image encoders from each file layout (the target:
loading costs one copy), as modules/benchmark/load_bench.py does for the transformer.

UMT5-XXL (resources/wan_configs/encoders/umt5-xxl.json, optionally with fewer layers so it fits a small machine: the
ratio to the file size is what is compared) and CLIP ViT-H/14 are built on the meta device and written as zeros (the
loader's memory does not depend on the values):
- `umt5_wan_pth`: the official `models_t5_umt5-xxl-enc-bf16.pth` (Wan's names, bf16, torch.save zip format);
- `umt5_comfyui_bf16`: ComfyUI's transformers-named safetensors, bf16;
- `umt5_comfyui_fp8_scaled`: the same with float8 block Linear weights, `scale_weight` tensors and the marker
  (dequantised to bf16 while loading: the growth is the bf16 model's, about twice the file);
- `umt5_comfyui_fp8_scaled_kept`: the same file loaded with `keep_fp8` (text encoder weight dtype FLOAT_8): the
  scaled layers stay float8 (the feed-forward outputs `wo` are dequantised);
- `clip_wan_pth`: the official CLIP `.pth` (vision tower, fp16; the text tower left out, it is not read);
- `clip_comfyui_fp16`: `clip_vision_h.safetensors`.
Each is loaded in bf16 in a fresh process, which reports its peak resident set before and after the load, with
every weight page touched.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.benchmark.common import GIB, run_in_fresh_process
from modules.benchmark.load_bench import write_streaming_safetensors

LAYOUTS = ("umt5_wan_pth", "umt5_comfyui_bf16", "umt5_comfyui_fp8_scaled", "umt5_comfyui_fp8_scaled_kept",
           "clip_wan_pth", "clip_comfyui_fp16")


def _meta_umt5(layers: int | None) -> dict[str, torch.Tensor]:
    from modules.util.empty_weights import empty_weights
    from transformers import UMT5Config, UMT5EncoderModel

    from modules.modelLoader.wan.parts.text_encoder_files import CONFIG_PATH
    config = json.loads(CONFIG_PATH.read_text(encoding="utf-8"))
    if layers:
        config.update(num_layers=layers, num_decoder_layers=layers)
    with empty_weights():
        return UMT5EncoderModel(UMT5Config(**config)).state_dict()


def _meta_clip() -> dict[str, torch.Tensor]:
    from modules.util.empty_weights import empty_weights
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from modules.modelLoader.wan.parts.image_encoder_files import CONFIG_DIR
    config = json.loads((CONFIG_DIR / "clip-vit-h-14.json").read_text(encoding="utf-8"))
    with empty_weights():
        state = CLIPVisionModel(CLIPVisionConfig(**config)).state_dict()
    return {f"vision_model.{k}": v for k, v in state.items()}


def _save_pth_of_zeros(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """torch.save of zero tensors mapped from a sparse file of zeros: the writer never holds the model in RAM."""
    largest = max(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                  for shape, dtype in specs.values())
    zeros = path.with_suffix(".zeros")
    with open(zeros, "wb") as file:
        file.truncate(largest)
    try:
        state = {key: torch.from_file(str(zeros), shared=False, size=torch.Size(shape).numel(), dtype=dtype)
                 .reshape(shape) for key, (shape, dtype) in specs.items()}
        torch.save(state, path)
    finally:
        zeros.unlink()


def write_layout(layout: str, folder: Path, text_layers: int | None) -> Path:
    from modules.util.encoder_keys import SCALED_FP8_MARKER
    from modules.util.tiny_model_files import (clip_vision_to_comfyui, hf_to_wan_clip, is_scaled_text_encoder_weight,
                                               umt5_to_comfyui, umt5_to_wan_t5)
    folder.mkdir(parents=True, exist_ok=True)
    if layout.startswith("umt5"):
        meta = _meta_umt5(text_layers)
        if layout == "umt5_wan_pth":
            path = folder / "models_t5_umt5-xxl-enc-bf16.pth"
            _save_pth_of_zeros(path, {k: (tuple(v.shape), torch.bfloat16) for k, v in umt5_to_wan_t5(meta).items()})
            return path
        state = umt5_to_comfyui(meta)
        if layout.startswith("umt5_comfyui_fp8_scaled"):
            specs = {}
            for key, value in state.items():
                if is_scaled_text_encoder_weight(key, tuple(value.shape)):
                    specs[key] = (tuple(value.shape), torch.float8_e4m3fn)
                    specs[key.removesuffix(".weight") + ".scale_weight"] = ((), torch.float32)
                else:
                    specs[key] = (tuple(value.shape), torch.bfloat16)
            specs[SCALED_FP8_MARKER] = ((0,), torch.float8_e4m3fn)
            path = folder / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
        else:
            specs = {k: (tuple(v.shape), torch.bfloat16) for k, v in state.items()}
            path = folder / "umt5_xxl_bf16.safetensors"
        write_streaming_safetensors(path, specs)
        return path
    meta = _meta_clip()
    projection = torch.empty(1024, 1280, device="meta")
    if layout == "clip_wan_pth":
        path = folder / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
        _save_pth_of_zeros(path, {k: (tuple(v.shape), torch.float16) for k, v in
                                  hf_to_wan_clip(meta, projection).items()})
        return path
    path = folder / "clip_vision_h.safetensors"
    write_streaming_safetensors(path, {k: (tuple(v.shape), torch.float16) for k, v in
                                       clip_vision_to_comfyui(meta, projection).items()})
    return path


def _peak_rss_bytes() -> int:
    """This process's own peak resident set (VmHWM): unlike ru_maxrss it is not carried over from the parent that
    forked it (the parent here has just written the files through memory maps)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure_in_this_process(layout: str, path: Path) -> dict:
    """Imports first (their memory is the baseline), then loads the encoder in bf16 and reports the peaks."""
    import time

    from modules.modelLoader.wan.parts.image_encoder_files import load_image_encoder, recognise_image_encoder
    from modules.modelLoader.wan.parts.tensor_files import read_keys_and_shapes
    from modules.modelLoader.wan.parts.text_encoder_files import load_text_encoder, recognise_text_encoder
    baseline = _peak_rss_bytes()
    start = time.perf_counter()
    keys = read_keys_and_shapes(path)
    if layout.startswith("umt5"):
        model = load_text_encoder([path], recognise_text_encoder(keys), torch.bfloat16,
                                  keep_fp8=layout.endswith("_kept"))
    else:
        model, _ = load_image_encoder([path], recognise_image_encoder(keys), torch.bfloat16)
    seconds = time.perf_counter() - start
    for tensor in model.state_dict().values():   # every weight resident, as when it encodes
        if tensor.numel():
            tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum()
    peak = _peak_rss_bytes()
    unique = {t.data_ptr(): t for t in model.state_dict().values()}   # the tied embedding once
    weights = sum(t.numel() * t.element_size() for t in unique.values())
    return {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "weights_bytes": weights, "seconds": seconds}


def run_encoder_load_benchmark(workdir: Path, layouts=LAYOUTS, text_layers: int | None = None,
                               keep_files: bool = False, log=print) -> list[dict]:
    rows = []
    for layout in layouts:
        path = write_layout(layout, workdir, text_layers)
        size = path.stat().st_size
        log(f"{layout}: wrote {size / GIB:.2f} GiB to {path}; loading in a fresh process (bf16)")
        call = f"measure_in_this_process({layout!r}, Path({str(path)!r}))"
        measured = run_in_fresh_process("modules.benchmark.encoder_load_bench", call, f"loading {layout}")
        growth = measured["peak_rss_bytes"] - measured["baseline_rss_bytes"]
        rows.append({"layout": layout, "file_gib": size / GIB, "weights_gib": measured["weights_bytes"] / GIB,
                     "load_growth_gib": growth / GIB, "growth_over_file": growth / size,
                     "growth_over_weights": growth / measured["weights_bytes"], "seconds": measured["seconds"]})
        if not keep_files:
            path.unlink()
    return rows
