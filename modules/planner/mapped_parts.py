"""Which model parts the loader leaves memory-mapped from their files instead of copying into the process's memory.

A part read in its file's own dtype is not copied: `from_pretrained` (a diffusers or transformers part folder)
opens its safetensors memory-mapped and each tensor that needs no cast stays a view of the file's mapping, and the
tensor reader (modules/modelLoader/wan/parts/state_reads.py) uses a `.pth` tensor in its target dtype as mapped. Its
pages are file-backed: resident once read (in RSS), not anonymous memory, and the kernel may drop them again. A
part that is cast as read (a float32 file loaded in bfloat16), or read from safetensors by the tensor reader
(pread into fresh buffers), is anonymous memory. So is a mapped part once it is moved to a device and back: its
host copy is new (host_plan.py decides per phase).

No weight is read: only the files' headers, as the loader finds the parts (model_plan.plan_model). Without files
(a released model planned by name) no part counts as mapped.
"""
from __future__ import annotations

from modules.util.config.ModelConfig import ModelConfig

# the loader's part names -> the host plan's
PLAN_NAMES = {"transformer": "transformer", "transformer_2": "transformer_2", "vae": "VAE",
              "text_encoder": "text encoder", "image_encoder": "image encoder"}
_cache: dict[tuple, frozenset[str]] = {}


def mapped_parts(config: ModelConfig) -> frozenset[str]:
    """The host plan's names of the parts loaded as views of their files' memory mappings."""
    key = (config.base_model_name, config.tokenizer.path) + tuple(
        (getattr(config, name).path, getattr(config, name).weight_dtype.value) for name in PLAN_NAMES)
    if key not in _cache:
        _cache[key] = _find(config)
    return _cache[key]


def _find(config: ModelConfig) -> frozenset[str]:
    from pathlib import Path
    from modules.modelLoader.wan.parts.model_plan import plan_model
    from modules.modelLoader.wan.parts.tensor_files import PICKLE_MODEL_SUFFIXES, ModelFileError
    from modules.modelLoader.wan.parts.transformer_files import dtype_label
    if not config.base_model_name or not Path(config.base_model_name).is_dir():
        return frozenset()
    try:
        plan = plan_model(config)
    except ModelFileError:   # the config check names it; the plan counts every part as copied
        return frozenset()
    mapped = set()
    for name, found in plan.parts.items():
        weight_dtype = getattr(config, name).weight_dtype
        if weight_dtype.is_quantized or weight_dtype.value == "FLOAT_8":
            continue   # quantized, or cast to float8 tensor by tensor (load_folder_transformer_fp8)
        if found.dtype != dtype_label(str(weight_dtype.torch_dtype()).removeprefix("torch.")):
            continue   # cast as read: a fresh copy
        if found.folder is not None or all(f.name.lower().endswith(PICKLE_MODEL_SUFFIXES) for f in found.files):
            mapped.add(PLAN_NAMES[name])
    return frozenset(mapped)
