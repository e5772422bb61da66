"""The Wan VAE in the layouts users hold it: a diffusers `vae/` folder, the official `Wan2.1_VAE.pth` /
`Wan2.2_VAE.pth` (the Wan repository's module names) and ComfyUI's `wan_2.1_vae.safetensors` /
`wan2.2_vae.safetensors` (the same names as the official files).

Key maps: Wan 2.1 through diffusers' own `convert_wan_vae_to_diffusers` (diffusers/loaders/single_file_utils.py);
Wan 2.2 (the 48-channel VAE of TI2V-5B, whose blocks nest `downsamples.N.downsamples.M`) after `convert_vae_22` in
huggingface/diffusers scripts/convert_wan_to_diffusers.py, which the installed diffusers has no single-file
converter for.
"""
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

from modules.modelLoader.wan.parts.state_reads import TensorRead, read_state
from modules.modelLoader.wan.parts.tensor_files import (BUNDLED_MODEL_PREFIXES, DIFFUSION_MODEL_PREFIXES,
                                                        ModelFileError, TensorInfo, open_tensors)
from modules.modelLoader.wan.parts.transformer_files import dtype_label, key_mismatch
from modules.modelLoader.wan.parts.wan_configs import released_configs
from modules.util.empty_weights import empty_weights

# residual block parts: official Sequential index -> diffusers name (both Wan VAE versions)
_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_NESTED = re.compile(r"^(?P<side>encoder|decoder)\.(?P<outer>downsamples|upsamples)\.(?P<block>\d+)\."
                     r"(?P=outer)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class VaeFile:
    layout: str                 # "diffusers", "wan2.1", "wan2.2"
    dtype: str
    z_dim: int
    names: dict[str, str]       # diffusers name -> key in the file
    shapes: dict[str, TensorInfo]

    @property
    def version(self) -> str:
        return "2.2" if self.z_dim == 48 else "2.1"


def _convert_wan22_name(key: str) -> str:
    """One official Wan 2.2 VAE key -> diffusers (the rules of diffusers' `convert_vae_22`, per key)."""
    match = _NESTED.match(key)
    if match is None:
        # the middle, head, conv_in and quant convs are named as in Wan 2.1
        return next(iter(convert_wan_vae_to_diffusers({key: key})))
    side, block, rest = match["side"], match["block"], match["rest"]
    blocks = "down_blocks" if side == "encoder" else "up_blocks"
    if rest in _RESIDUAL:
        return f"{side}.{blocks}.{block}.resnets.{match['index']}.{_RESIDUAL[rest]}"
    sampler = "downsampler" if side == "encoder" else "upsampler"
    return f"{side}.{blocks}.{block}.{sampler}.{rest}"   # resample.1.* / time_conv.*


# where a VAE sits in a file: alone (no prefix), or in a checkpoint bundling several models (ComfyUI's
# save_checkpoint writes a Wan VAE under `vae.`, comfy/supported_models.py WAN21_T2V `vae_key_prefix`; older
# checkpoints use `first_stage_model.`)
VAE_PREFIXES = ("", "vae.", "first_stage_model.")
_OTHER_MODELS = DIFFUSION_MODEL_PREFIXES + BUNDLED_MODEL_PREFIXES
_ANCHORS = ("decoder.mid_block.resnets.0.norm1.gamma", "decoder.middle.0.residual.0.gamma")


def _vae_keys(keys: dict[str, TensorInfo]) -> dict[str, str] | None:
    """The VAE's own names -> keys in the file (its prefix removed), or None when the file holds no Wan VAE. A
    VAE file's every tensor is its own (an unknown one is reported by the key check, never dropped); in a
    checkpoint, the tensors under the VAE's prefix."""
    for prefix in VAE_PREFIXES:
        if any(prefix + anchor in keys for anchor in _ANCHORS):
            if prefix:
                return {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
            return {key: key for key in keys if not key.startswith(_OTHER_MODELS)}
    return None


def recognise_vae(keys: dict[str, TensorInfo]) -> VaeFile | None:
    own = _vae_keys(keys)
    if own is None:
        return None
    if "decoder.mid_block.resnets.0.norm1.gamma" in own and "post_quant_conv.weight" in own:
        layout, names = "diffusers", {name: name for name in own}
    elif "decoder.middle.0.residual.0.gamma" in own and "conv2.weight" in own:
        if any(_NESTED.match(name) for name in own):
            layout, names = "wan2.2", {_convert_wan22_name(name): name for name in own}
        else:
            layout = "wan2.1"
            names = convert_wan_vae_to_diffusers({name: name for name in own})
    else:
        return None
    names = {name: own[local] for name, local in names.items()}
    shapes = {name: keys[key] for name, key in names.items()}
    z_dim = shapes["post_quant_conv.weight"].shape[0] if "post_quant_conv.weight" in shapes else 0
    dtype = dtype_label(shapes["decoder.conv_in.weight"].dtype) if "decoder.conv_in.weight" in shapes else "unknown"
    return VaeFile(layout, dtype, z_dim, names, shapes)


def vae_config_for(file: VaeFile, given: dict | None) -> dict:
    """`given` (a config.json beside the file, or the base model's) or the released VAE of that latent width, with
    the widths read from the tensors (so a narrower VAE of the same design loads too)."""
    if given:
        return dict(given)
    release = "wan2.2-ti2v-5b" if file.z_dim == 48 else "wan2.1-t2v-14b"
    config = dict(released_configs()[release]["vae"])
    base_dim = file.shapes["encoder.conv_in.weight"].shape[0]
    decoder_in = file.shapes["decoder.conv_in.weight"].shape[0]   # decoder_base_dim * dim_mult[-1]
    config["base_dim"] = base_dim
    decoder_base = decoder_in // config["dim_mult"][-1]
    config["decoder_base_dim"] = None if decoder_base == base_dim and config.get("decoder_base_dim") is None \
        else decoder_base
    return config


def check_vae_keys(file: VaeFile, config: dict, source: str) -> None:
    problem = key_mismatch(AutoencoderKLWan, config, file.shapes)
    if problem:
        raise ModelFileError(f"{source}: the tensors do not make the Wan {file.version} VAE (z_dim {file.z_dim}) of "
                             f"this config: {problem}; a VAE of another design needs its config.json beside the "
                             f"file")


def load_vae(paths: list[Path], file: VaeFile, config: dict, dtype: torch.dtype, source: str) -> AutoencoderKLWan:
    check_vae_keys(file, config, source)
    with empty_weights():
        model = AutoencoderKLWan.from_config(config)
    reads = {}
    for name, key in file.names.items():
        info = file.shapes[name]
        stored = getattr(torch, info.dtype)
        reads[name] = TensorRead(key, info.shape, dtype if stored.is_floating_point else stored, info.dtype)
    with open_tensors(paths) as tensors:
        state = read_state(tensors, reads)   # one copy in memory, also when casting (files-enc's state_reads)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
