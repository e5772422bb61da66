"""Writes a tiny diffusers Wan model's transformer and VAE in the layouts users hold them, with the real key names.

Key maps (each the inverse of the public conversion to diffusers):
- transformer, official Wan / ComfyUI names: modules/util/lora/keys.py KEY_TABLE, which lists the renames of
  huggingface/diffusers scripts/convert_wan_to_diffusers.py `TRANSFORMER_KEYS_RENAME_DICT` (the official
  Wan2.1 `wan/modules/model.py` module names); ComfyUI checkpoints prefix them with `model.diffusion_model.`
  (comfy/model_detection.py `unet_prefix_from_state_dict`).
- fp8_scaled: ComfyUI's scaled fp8 files (comfy/ops.py `scaled_fp8_ops`): float8_e4m3fn Linear weights, a float32
  `<layer>.scale_weight` each (weight = fp8 * scale), and an empty float8 `scaled_fp8` marker tensor.
- Wan 2.1 VAE (`Wan2.1_VAE.pth`): inverse of diffusers' `convert_wan_vae_to_diffusers`
  (diffusers/loaders/single_file_utils.py): flat `encoder.downsamples.N`, decoder `upsamples.N` with N = 4 * block +
  resnet (the upsampler at 4 * block + 3), `middle.0/1/2`, `head.0/2`, `conv1`/`conv2` for the quant convs.
- ComfyUI checkpoint (comfy/sd.py `save_checkpoint`, `BaseModel.state_dict_for_saving` with the prefixes of
  comfy/supported_models.py WAN21_T2V): the transformer under `model.diffusion_model.`, the VAE (official names)
  under `vae.`, the text encoder as `text_encoders.` + the SD1ClipModel state dict (`umt5xxl.transformer.<T5
  names>`, `umt5xxl.logit_scale`) + the tokenizer's `spiece_model`.
(The text and image encoders' files: modules/util/tiny_model_files.py. The official names every writer here must
produce: tests/fixtures/official_wan_key_names.json, checked by tests/test_official_key_names.py.)
- Wan 2.2 VAE (`Wan2.2_VAE.pth`): inverse of `convert_vae_22` in huggingface/diffusers
  scripts/convert_wan_to_diffusers.py: nested `downsamples.B.downsamples.I` / `upsamples.B.upsamples.I`, the
  resampler at index num_res_blocks (encoder) / num_res_blocks + 1 (decoder).
"""
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.util.fp8_scaled import quantise_scaled_fp8
from modules.util.lora.keys import diffusers_to_original_state_dict

COMFY_PREFIX = "model.diffusion_model."
_RESNET = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
           "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
           "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}
_COMMON = {"encoder.conv_in.": "encoder.conv1.", "decoder.conv_in.": "decoder.conv1.", "quant_conv.": "conv1.",
           "post_quant_conv.": "conv2.", "encoder.norm_out.gamma": "encoder.head.0.gamma",
           "decoder.norm_out.gamma": "decoder.head.0.gamma", "encoder.conv_out.": "encoder.head.2.",
           "decoder.conv_out.": "decoder.head.2."}


def transformer_to_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    return diffusers_to_original_state_dict(state, prefix=prefix)


def to_fp8_scaled(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI fp8_scaled from an original-key state dict: every Linear weight of the blocks (and VACE blocks)
    quantised."""
    out: dict[str, torch.Tensor] = {}
    for key, value in original.items():
        name = key.removeprefix(COMFY_PREFIX)
        if name.startswith(("blocks.", "vace_blocks.")) and key.endswith(".weight") and value.dim() == 2:
            out[key], out[key.removesuffix(".weight") + ".scale_weight"] = quantise_scaled_fp8(value)
        else:
            out[key] = value
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in original) else ""
    out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def dequantised(fp8_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights an fp8_scaled state dict stands for (the reference it is compared with)."""
    out = {}
    for key, value in fp8_state.items():
        if key.endswith("scaled_fp8") or key.endswith(".scale_weight"):
            continue
        scale = fp8_state.get(key.removesuffix(".weight") + ".scale_weight")
        out[key] = value.float() * scale if scale is not None else value.float()
    return out


def _common(key: str) -> str | None:
    for side in ("encoder", "decoder"):
        match = re.match(rf"^{side}\.mid_block\.resnets\.(\d)\.(.+)$", key)
        if match:
            return f"{side}.middle.{2 * int(match[1])}.{_RESNET[match[2]]}"
        if key.startswith(f"{side}.mid_block.attentions.0."):
            return f"{side}.middle.1." + key.removeprefix(f"{side}.mid_block.attentions.0.")
    for new, old in _COMMON.items():
        if key.startswith(new):
            return old + key[len(new):]
    return None


def vae21_to_original(state: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = _common(key)
        if name is None and (match := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", key)):
            rest = _RESNET.get(match[2], match[2])
            name = f"encoder.downsamples.{match[1]}.{rest}"
        elif name is None and (match := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key)):
            name = f"decoder.upsamples.{int(match[1]) * (num_res_blocks + 2) + int(match[2])}.{_RESNET[match[3]]}"
        elif name is None and (match := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", key)):
            name = f"decoder.upsamples.{int(match[1]) * (num_res_blocks + 2) + num_res_blocks + 1}.{match[2]}"
        assert name is not None, key
        out[name] = value
    return out


def vae22_to_original(state: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = _common(key)
        if name is None and (match := re.match(r"^(encoder|decoder)\.(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$",
                                               key)):
            outer = "downsamples" if match[1] == "encoder" else "upsamples"
            name = f"{match[1]}.{outer}.{match[3]}.{outer}.{match[4]}.{_RESNET[match[5]]}"
        elif name is None and (match := re.match(r"^encoder\.down_blocks\.(\d+)\.downsampler\.(.+)$", key)):
            name = f"encoder.downsamples.{match[1]}.downsamples.{num_res_blocks}.{match[2]}"
        elif name is None and (match := re.match(r"^decoder\.up_blocks\.(\d+)\.upsampler\.(.+)$", key)):
            name = f"decoder.upsamples.{match[1]}.upsamples.{num_res_blocks + 1}.{match[2]}"
        assert name is not None, key
        out[name] = value
    return out


def _official_model_type(diffusers_config: dict) -> str:
    """WanModel's `model_type` as the releases' config.json hold it: t2v, i2v, flf2v (Wan2.1 model.py), ti2v
    (Wan2.2 model.py; the A14B experts are t2v / i2v)."""
    if diffusers_config.get("pos_embed_seq_len"):
        return "flf2v"
    return {36: "i2v", 48: "ti2v"}.get(diffusers_config["in_channels"], "t2v")


def official_transformer_config(diffusers_config: dict) -> dict:
    """The official Wan repository's config.json for a transformer (wan/modules/model.py `WanModel` arguments)."""
    heads = diffusers_config["num_attention_heads"]
    return {"_class_name": "WanModel", "_diffusers_version": "0.30.0",
            "dim": heads * diffusers_config["attention_head_dim"],
            "eps": diffusers_config["eps"], "ffn_dim": diffusers_config["ffn_dim"],
            "freq_dim": diffusers_config["freq_dim"], "in_dim": diffusers_config["in_channels"],
            "model_type": _official_model_type(diffusers_config), "num_heads": heads,
            "num_layers": diffusers_config["num_layers"], "out_dim": diffusers_config["out_channels"], "text_len": 512}


def sample_tiny_video(base, out, extra: list[str]) -> int:
    """scripts/sample.py in this process: one 5-frame 32x32 video of 2 steps from `base` (+ `extra` arguments) into
    `out`; returns the frame count of the one video written."""
    from pathlib import Path

    import av

    from tests.script_loader import load_script
    script = load_script("sample")
    assert script.main(["--base-model-name", str(base), "--prompt", "a red square moving left", "--width", "32",
                        "--height", "32", "--frames", "5", "--steps", "2", "--device", "cpu", "--output-dir",
                        str(out), *extra]) == 0
    [video] = Path(out).glob("*.mp4")
    with av.open(str(video)) as container:
        return sum(1 for _ in container.decode(video=0))


def comfy_checkpoint(transformer: dict[str, torch.Tensor], vae: dict[str, torch.Tensor],
                     text_encoder: dict[str, torch.Tensor], spiece_model: torch.Tensor | None = None
                     ) -> dict[str, torch.Tensor]:
    """One file as ComfyUI's Save Checkpoint writes a Wan model: diffusers state dicts of the three parts in."""
    from modules.util.tiny_model_files import umt5_to_comfyui
    out = transformer_to_original(transformer, prefix=COMFY_PREFIX)
    to_original = vae22_to_original if vae["post_quant_conv.weight"].shape[0] == 48 else vae21_to_original
    out.update({f"vae.{key}": value for key, value in to_original(vae).items()})
    out.update({f"text_encoders.umt5xxl.transformer.{key}": value
                for key, value in umt5_to_comfyui(text_encoder).items()})
    out["text_encoders.umt5xxl.logit_scale"] = torch.tensor(4.6055)
    if spiece_model is not None:
        out["text_encoders.spiece_model"] = spiece_model
    return out


def write_release_transformer(base: Path, folder: Path) -> Path:
    """The Wan-AI release's transformer from a diffusers folder `base`: original-key shards
    `diffusion_pytorch_model-0000N-of-00002.safetensors`, their index and the official config.json; returns the
    index file."""
    original = transformer_to_original(load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors")))
    names = sorted(original)
    weight_map = {}
    for index, half in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        shard = f"diffusion_pytorch_model-0000{index}-of-00002.safetensors"
        save_file({k: original[k] for k in half}, str(folder / shard))
        weight_map.update(dict.fromkeys(half, shard))
    index_file = folder / "diffusion_pytorch_model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((base / "transformer" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(official_transformer_config(config)))
    return index_file
