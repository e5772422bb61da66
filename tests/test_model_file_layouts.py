"""Transformer and VAE files in the layouts users hold them (official Wan release, ComfyUI single files, fp8 and
fp8_scaled) load into models that compute what the diffusers-folder model computes."""
import json
import shutil

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file, save_file

from modules.modelLoader.wan.parts.recognise import find_parts
from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.modelLoader.wan.parts.transformer_files import load_transformer
from modules.modelLoader.wan.parts.vae_files import load_vae, vae_config_for
from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
from modules.util.enum.DataType import DataType
from tests.wan_file_layouts import (COMFY_PREFIX, dequantised, official_transformer_config, to_fp8_scaled,
                                    transformer_to_original, vae21_to_original, vae22_to_original)


def _config(model) -> dict:
    return {"_class_name": type(model).__name__, **{k: v for k, v in model.config.items() if not k.startswith("_")}}


def _transformer_state(folder):
    return load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def _inputs(config, frames=2, image_tokens=0, images=1):
    generator = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, config["in_channels"], frames, 4, 4, generator=generator),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, config["text_dim"], generator=generator))
    if image_tokens:
        inputs["encoder_hidden_states_image"] = torch.randn(images, image_tokens, config["image_dim"],
                                                               generator=generator)
    return inputs


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


def _load_found(path, weight_dtype=DataType.FLOAT_32):
    [found] = find_parts(path)
    assert found.part == "transformer"
    # the config.json beside the file: diffusers' or the official code's, read as the model plan reads it
    config = transformer_config_from_shapes(found.detail.shapes, str(path), found.config)
    return found, load_transformer(found.files, found.detail, config, weight_dtype, str(path))


@pytest.mark.parametrize("variant,layout", [("wan2.1-t2v", "wan_sharded"), ("wan2.1-t2v", "wan_sharded_dumped"),
                                            ("wan2.1-t2v", "comfyui"),
                                            ("wan2.1-flf2v", "comfyui_bare_prefix"), ("wan2.2-ti2v-5b", "wan"),
                                            ("wan2.1-i2v", "diffusers_file")])
def test_transformer_layouts_compute_what_the_diffusers_folder_computes(tiny_model, tmp_path, variant, layout):
    folder = tiny_model(variant)
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer").eval()
    state = _transformer_state(folder)
    out = tmp_path / "files"
    out.mkdir()
    if layout.startswith("wan_sharded"):
        # the official release: original names in shards + index, and the Wan repository's own config.json
        original = transformer_to_original(state)
        names = sorted(original)
        halves = [names[: len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for index, half in enumerate(halves, start=1):
            shard = f"diffusion_pytorch_model-0000{index}-of-00002.safetensors"
            save_file({k: original[k] for k in half}, str(out / shard))
            weight_map.update({k: shard for k in half})
        (out / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        official = official_transformer_config(_config(reference))
        if layout == "wan_sharded_dumped":
            # the official code's config written as a plain dict (json.dump(model.config)): no `_class_name`; the
            # 64-wide tiny model is no released width, so only this file gives its head count
            official = {k: v for k, v in official.items() if not k.startswith("_")}
        (out / "config.json").write_text(json.dumps(official))
        path = out / "diffusion_pytorch_model.safetensors.index.json"
    else:
        prefix = {"comfyui": COMFY_PREFIX, "comfyui_bare_prefix": "diffusion_model.", "wan": ""}.get(layout)
        tensors = state if layout == "diffusers_file" else transformer_to_original(state, prefix=prefix)
        path = out / "model.safetensors"
        save_file(tensors, str(path))
        (out / "config.json").write_text(json.dumps(_config(reference)))
        if layout == "comfyui" and variant == "wan2.1-t2v":
            # diffusers' own single-file converter reads the same names to the same diffusers names
            converted = convert_wan_transformer_to_diffusers({k: k for k in tensors})
            assert sorted(converted) == sorted(state)
    found, model = _load_found(path)
    expected_layout = {"wan_sharded": "wan", "wan_sharded_dumped": "wan", "comfyui_bare_prefix": "comfyui",
                       "diffusers_file": "diffusers"}
    assert (found.layout, found.dtype) == (expected_layout.get(layout, layout), "fp32")
    # FLF2V: two CLIP images of 17 tokens each, joined by the model into one sequence with a position embedding
    images = 2 if reference.config.pos_embed_seq_len else 1
    image_tokens = 17 if reference.config.image_dim else 0
    inputs = _inputs(dict(reference.config), image_tokens=image_tokens, images=images)
    torch.testing.assert_close(_forward(model, inputs), _forward(reference, inputs), atol=1e-6, rtol=0)


def test_an_official_config_that_contradicts_its_tensors_is_refused_naming_each_field(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    save_file(transformer_to_original(_transformer_state(folder)), str(tmp_path / "model.safetensors"))
    reference = json.loads((folder / "transformer" / "config.json").read_text())
    official = official_transformer_config(reference) | {"ffn_dim": 512, "model_type": "flf2v"}
    (tmp_path / "config.json").write_text(json.dumps(official))
    [found] = find_parts(tmp_path / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"config\.json .*ffn_dim 512, the tensors 256.*model_type 'flf2v'"):
        transformer_config_from_shapes(found.detail.shapes, str(tmp_path / "model.safetensors"), found.config)


def test_fp8_scaled_transformer_stays_fp8_and_matches_its_dequantised_weights(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer").eval()
    scaled = to_fp8_scaled(transformer_to_original(_transformer_state(folder), prefix=COMFY_PREFIX))
    path = tmp_path / "wan2.1_t2v_tiny_fp8_scaled.safetensors"
    save_file(scaled, str(path))
    (tmp_path / "config.json").write_text(json.dumps(_config(reference)))
    found, model = _load_found(path, DataType.FLOAT_8)   # the presets' weight dtype: bfloat16 compute
    assert (found.layout, found.dtype) == ("comfyui", "fp8_scaled")
    q = model.blocks[0].attn1.to_q
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_weight.dtype == torch.float32
    # the reference: the same fp8 numbers, dequantised once to float32, computed in bfloat16 as the model does
    from modules.util.lora.keys import original_to_diffusers_state_dict
    dequant = original_to_diffusers_state_dict(dequantised(scaled))
    reference.load_state_dict(dequant)
    inputs = _inputs(dict(reference.config))
    expected = _forward(reference.to(torch.bfloat16), {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                                        for k, v in inputs.items()})
    got = _forward(model, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()})
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant,suffix", [("wan2.1-t2v", ".pth"), ("wan2.2-ti2v-5b", ".pth"),
                                            ("wan2.1-t2v", ".safetensors")])
def test_vae_layouts_encode_and_decode_as_the_diffusers_folder(tiny_model, tmp_path, variant, suffix):
    folder = tiny_model(variant)
    reference = AutoencoderKLWan.from_pretrained(folder, subfolder="vae").eval()
    state = load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    original = (vae22_to_original if reference.config.z_dim == 48 else vae21_to_original)(state)
    path = tmp_path / (("Wan2.2_VAE" if reference.config.z_dim == 48 else "Wan2.1_VAE") + suffix)
    if suffix == ".pth":
        torch.save(original, path)
    else:
        save_file(original, str(path))
    [found] = find_parts(path)
    assert (found.part, found.layout) == ("vae", "wan2.2" if reference.config.z_dim == 48 else "wan2.1")
    config = vae_config_for(found.detail, None)
    # the latent statistics of a tiny VAE are calibrated, in no tensor: the released ones are used
    config.update(latents_mean=reference.config.latents_mean, latents_std=reference.config.latents_std)
    vae = load_vae(found.files, found.detail, config, torch.float32, str(path))
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents, expected_latents = vae.encode(video).latent_dist.mean, reference.encode(video).latent_dist.mean
        torch.testing.assert_close(latents, expected_latents, atol=1e-6, rtol=0)
        torch.testing.assert_close(vae.decode(latents).sample, reference.decode(latents).sample, atol=1e-6, rtol=0)


def test_e2v_expansion_keeps_an_fp8_scaled_base_in_float8_and_its_output(tiny_model, tmp_path):
    from modules.model.e2v_expansion import expand_t2v_for_e2v
    from modules.util.fp8_scaled import ScaledFp8Linear
    folder = tiny_model("wan2.1-t2v")
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    path = tmp_path / "t2v_fp8_scaled.safetensors"
    save_file(to_fp8_scaled(transformer_to_original(_transformer_state(folder))), str(path))
    (tmp_path / "config.json").write_text(json.dumps(_config(reference)))
    _, base = _load_found(path, DataType.FLOAT_8)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _inputs(_config(reference)).items()}
    # diffusers takes the last 512 text tokens as text when image tokens come first
    inputs["encoder_hidden_states"] = torch.randn(1, 512, reference.config.text_dim, dtype=torch.bfloat16)
    expected = _forward(base, inputs)
    expanded = expand_t2v_for_e2v(base, condition_channels=20, image_dim=24)
    assert isinstance(expanded.blocks[0].attn1.to_q, ScaledFp8Linear)
    assert expanded.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    assert expanded.blocks[0].attn2.add_k_proj.weight.dtype == torch.bfloat16   # new, trained: not fp8
    condition = torch.zeros(1, 20, *inputs["hidden_states"].shape[2:], dtype=torch.bfloat16)
    image = torch.randn(1, 17, 24, dtype=torch.bfloat16)
    got = _forward(expanded, {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], condition], dim=1),
                              "encoder_hidden_states_image": image})
    # zero condition weights and a zero add_v_proj: the expanded model computes what the base computed
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_merging_a_lora_into_an_fp8_scaled_layer_adds_to_its_dequantised_weight():
    from modules.util.fp8_scaled import make_scaled_fp8, quantise_scaled_fp8
    from modules.util.lora.apply import merge_lora
    from modules.util.lora.formats import LoraModule
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=generator) * 0.02
    layer = torch.nn.Linear(6, 8)
    weight, scale = quantise_scaled_fp8(full)
    make_scaled_fp8(layer, scale)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    lora = LoraModule(down=torch.randn(2, 6, generator=generator) * 0.1,
                      up=torch.randn(8, 2, generator=generator) * 0.1, alpha=2.0)
    root = torch.nn.Module()
    root.add_module("proj", layer)
    before = layer.dequantised_weight(torch.float32)
    merge_lora(root, {"proj": lora})
    expected = before + lora.delta()
    got = layer.dequantised_weight(torch.float32)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.isfinite(got).all()
    # within float8's precision at this scale (3 mantissa bits, values clamped to the representable range)
    assert (got - expected).abs().max() <= expected.abs().max() * 2 ** -3


def test_fp8_e4m3fn_transformer_stays_fp8_and_matches_its_upcast_weights(tiny_model, tmp_path):
    """ComfyUI's `*_fp8_e4m3fn.safetensors`: the block Linear weights in float8 without scales."""
    folder = tiny_model("wan2.1-t2v")
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer").eval()
    original = transformer_to_original(_transformer_state(folder), prefix=COMFY_PREFIX)
    fp8 = {k: v.to(torch.float8_e4m3fn) if k.removeprefix(COMFY_PREFIX).startswith("blocks.") and v.dim() == 2
           else v.to(torch.bfloat16) for k, v in original.items()}
    path = tmp_path / "wan2.1_t2v_tiny_fp8_e4m3fn.safetensors"
    save_file(fp8, str(path))
    (tmp_path / "config.json").write_text(json.dumps(_config(reference)))
    found, model = _load_found(path, DataType.BFLOAT_16)
    assert (found.layout, found.dtype) == ("comfyui", "fp8_e4m3fn")
    assert model.blocks[0].ffn.net[0].proj.weight.dtype == torch.float8_e4m3fn   # not upcast in memory
    from modules.util.lora.keys import original_to_diffusers_state_dict
    reference.load_state_dict({k: v.float() for k, v in original_to_diffusers_state_dict(fp8).items()})
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _inputs(_config(reference)).items()}
    expected = _forward(reference.to(torch.bfloat16), inputs)
    torch.testing.assert_close(_forward(model, inputs), expected, atol=2e-2, rtol=2e-2)


def test_float8_weights_from_a_full_precision_file_are_cast_as_read(tiny_model, tmp_path):
    """model.transformer.weight_dtype FLOAT_8 with a bf16 / fp32 file: the layers diffusers' layerwise casting
    stores in float8 are float8 straight from the reader; the rest computes in bfloat16."""
    folder = tiny_model("wan2.1-t2v")
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer").eval()
    path = tmp_path / "wan2.1_t2v_tiny_fp32.safetensors"
    save_file(transformer_to_original(_transformer_state(folder), prefix=COMFY_PREFIX), str(path))
    (tmp_path / "config.json").write_text(json.dumps(_config(reference)))
    _, model = _load_found(path, DataType.FLOAT_8)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    assert model.patch_embedding.weight.dtype == torch.bfloat16   # skipped by layerwise casting (patch_embed)
    # the project's FLOAT_8 path on the diffusers folder (WanBaseModelLoader: bf16, then layerwise casting)
    float8 = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    float8.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _inputs(_config(reference)).items()}
    ours, theirs = model.state_dict(), float8.eval().state_dict()
    assert all(torch.equal(ours[k].float(), theirs[k].float()) and ours[k].dtype == theirs[k].dtype for k in ours)
    torch.testing.assert_close(_forward(model, inputs), _forward(float8, inputs), atol=0, rtol=0)


def test_every_released_config_is_found_again_from_its_shapes_alone():
    """The real sizes (resources/wan_configs): a file with no config beside it gets back the released config and
    variant from its tensor shapes, and the released VAE fits the VAE's shapes."""
    from accelerate import init_empty_weights
    from modules.modelLoader.wan.parts.tensor_files import TensorInfo
    from modules.modelLoader.wan.parts.vae_files import recognise_vae
    from modules.model.transformer_classes import transformer_class
    from modules.modelLoader.wan.parts.wan_configs import released_configs, variant_from_transformer
    from modules.model.transformer_classes import transformer_class
    for name, release in released_configs().items():
        with init_empty_weights():
            transformer = transformer_class(release["transformer"]).from_config(release["transformer"])
            vae = AutoencoderKLWan.from_config(release["vae"])
        shapes = {k: TensorInfo(tuple(v.shape), "bfloat16") for k, v in transformer.state_dict().items()}
        derived = transformer_config_from_shapes(shapes, name)
        assert {k: derived[k] for k in release["transformer"]} == release["transformer"], name
        z_dim = recognise_vae({k: TensorInfo(tuple(v.shape), "bfloat16") for k, v in vae.state_dict().items()}).z_dim
        two_experts = "boundary_ratio" in release["model_index"]
        assert variant_from_transformer(derived, z_dim, two_experts).value == release["variant"], name
        assert vae_config_for(recognise_vae({k: TensorInfo(tuple(v.shape), "bfloat16")
                                             for k, v in vae.state_dict().items()}), None) == release["vae"], name
