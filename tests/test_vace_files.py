"""Wan VACE models in the layouts users hold them load as `WanVACETransformer3DModel` and compute what the diffusers
folder computes: the diffusers folder (`WanVACEPipeline`), the official release (Wan-Video/Wan2.1
wan/modules/vace_model.py `VaceWanModel`: original names, `vace_blocks.N.before_proj` / `after_proj`, config.json with
`vace_layers`) and ComfyUI single files (the same names with or without `model.diffusion_model.`, no config: the
VACE blocks evenly spaced, as comfy/ldm/wan/model.py assumes), also in ComfyUI's fp8 forms (tests/wan_file_layouts.py,
modules/modelLoader/wan/parts/comfy_quant.py cite their names). The official names are checked against the official
module's state dict in tests/test_official_key_names.py."""
import json
from pathlib import Path

import pytest
import torch
from diffusers import WanVACETransformer3DModel
from safetensors.torch import load_file, save_file

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelLoader.wan.parts.model_plan import plan_model
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo
from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes, variant_from_transformer
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.tiny_model_files import write_official_encoders
from modules.util.wan_detection import detect_variant, detect_variant_from_folder
from tests.wan_file_layouts import COMFY_PREFIX, official_transformer_config, transformer_to_original, \
    vae21_to_original


@pytest.fixture(scope="module")
def vace(tiny_model) -> Path:
    return tiny_model("wan2.1-vace")


def _state(folder: Path, part: str) -> dict[str, torch.Tensor]:
    [weights] = sorted((folder / part).glob("*.safetensors"))
    return load_file(str(weights))


def _inputs(config: dict, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
                timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 8, config["text_dim"], generator=generator),
                control_hidden_states=torch.randn(1, config["vace_in_channels"], 2, 4, 4, generator=generator),
                control_hidden_states_scale=torch.tensor([1.0, 0.5]))


def _forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


def _official_vace_config(diffusers_config: dict) -> dict:
    """The release's config.json: WanModel's fields plus VaceWanModel's `vace_layers` and `vace_in_dim`."""
    return {**official_transformer_config(diffusers_config), "_class_name": "VaceWanModel", "model_type": "vace",
            "vace_layers": list(diffusers_config["vace_layers"]),
            "vace_in_dim": diffusers_config["vace_in_channels"]}


def test_the_diffusers_folder_is_a_vace_model_and_loads_every_tensor(vace):
    assert detect_variant_from_folder(vace) is WanVariant.VACE
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(vace)))
    assert model.variant is WanVariant.VACE and isinstance(model.transformer, WanVACETransformer3DModel)
    stored = _state(vace, "transformer")
    loaded = model.transformer.state_dict()
    assert set(loaded) == set(stored) and all(torch.equal(loaded[k], stored[k]) for k in stored)


def test_vace_fun_a14b_is_told_by_its_second_expert():
    config = {"_class_name": "WanVACETransformer3DModel", "in_channels": 16, "vace_layers": [0, 5]}
    index = {"_class_name": "WanVACEPipeline", "transformer": ["diffusers", "WanVACETransformer3DModel"],
             "transformer_2": ["diffusers", "WanVACETransformer3DModel"], "boundary_ratio": 0.875}
    assert detect_variant(index, config, {"z_dim": 16}) is WanVariant.VACE_A14B
    assert detect_variant({**index, "transformer_2": [None, None]}, config, {"z_dim": 16}) is WanVariant.VACE
    assert variant_from_transformer(config, 16, two_experts=True) is WanVariant.VACE_A14B
    assert WanVariant.VACE_A14B.has_two_experts and WanVariant.VACE_A14B.takes_control_video
    assert not WanVariant.T2V.takes_control_video and not WanVariant.I2V_A14B.is_vace


def test_a_file_without_config_gets_comfyuis_evenly_spaced_vace_layers():
    def shapes(vace_blocks: int, layers: int) -> dict[str, TensorInfo]:
        out = {"patch_embedding.weight": TensorInfo((64, 16, 1, 2, 2), "float16"),
               "proj_out.weight": TensorInfo((64, 64), "float16"),
               "condition_embedder.text_embedder.linear_1.weight": TensorInfo((64, 32), "float16"),
               "condition_embedder.time_embedder.linear_1.weight": TensorInfo((64, 256), "float16"),
               "blocks.0.ffn.net.0.proj.weight": TensorInfo((256, 64), "float16"),
               "vace_patch_embedding.weight": TensorInfo((64, 96, 1, 2, 2), "float16")}
        out.update({f"blocks.{i}.attn1.to_q.weight": TensorInfo((64, 64), "float16") for i in range(layers)})
        out.update({f"vace_blocks.{i}.proj_out.weight": TensorInfo((64, 64), "float16") for i in range(vace_blocks)})
        return out
    heads = {"num_attention_heads": 2, "attention_head_dim": 32}
    for vace_blocks, layers, expected in ((15, 30, list(range(0, 30, 2))), (8, 40, list(range(0, 40, 5))),
                                          (2, 4, [0, 2])):
        config = transformer_config_from_shapes(shapes(vace_blocks, layers), "f", heads)
        assert (config["_class_name"], config["vace_layers"], config["vace_in_channels"]) == \
               ("WanVACETransformer3DModel", expected, 96)
    with pytest.raises(ModelFileError, match=r"f: 2 VACE blocks and 4 base blocks do not fit the given vace_layers "
                                             r"\[0, 1, 2\]"):
        transformer_config_from_shapes(shapes(2, 4), "f", {**heads, "vace_layers": [0, 1, 2]})


@pytest.fixture(scope="module")
def spaced_unevenly(vace, tmp_path_factory) -> tuple[WanVACETransformer3DModel, Path]:
    """A VACE transformer whose blocks feed base blocks 0 and 3 (not ComfyUI's even spacing) as the official
    release holds it: original-key shards, their index, the official config.json; beside it the release's
    Wan2.1_VAE.pth, T5 .pth and google/umt5-xxl tokenizer."""
    config = dict(WanVACETransformer3DModel.load_config(vace, subfolder="transformer"), vace_layers=[0, 3])
    torch.manual_seed(1)
    reference = WanVACETransformer3DModel.from_config(config).eval()
    release = tmp_path_factory.mktemp("vace-release")
    original = transformer_to_original(reference.state_dict())
    names = sorted(original)
    weight_map = {}
    for index, half in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        shard = f"diffusion_pytorch_model-0000{index}-of-00002.safetensors"
        save_file({k: original[k].contiguous() for k in half}, str(release / shard))
        weight_map.update(dict.fromkeys(half, shard))
    (release / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (release / "config.json").write_text(json.dumps(_official_vace_config(dict(reference.config))))
    torch.save(vae21_to_original(_state(vace, "vae")), release / "Wan2.1_VAE.pth")
    write_official_encoders(vace, release)
    return reference, release


def test_the_official_release_folder_loads_with_its_vace_layers_and_computes_the_same(spaced_unevenly):
    reference, release = spaced_unevenly
    plan = plan_model(ModelConfig(base_model_name=str(release)))
    assert plan.variant is WanVariant.VACE and plan.parts["transformer"].layout == "wan"
    assert plan.model_index["_class_name"] == "WanVACEPipeline"
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(release)))
    assert model.transformer.config.vace_layers == [0, 3]
    inputs = _inputs(dict(reference.config))
    torch.testing.assert_close(_forward(model.transformer, inputs), _forward(reference, inputs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix", [COMFY_PREFIX, ""])
def test_a_comfyui_single_file_loads_and_computes_what_the_diffusers_folder_computes(vace, tmp_path, prefix):
    """Without a config beside it the file's VACE blocks are spaced evenly (ComfyUI's rule), which is the tiny
    model's own spacing; the base folder gives the head count."""
    path = tmp_path / "wan2.1_vace_1.3B_fp16.safetensors"
    save_file(transformer_to_original(_state(vace, "transformer"), prefix=prefix), str(path))
    config = ModelConfig(base_model_name=str(vace), transformer={"path": str(path)})
    assert plan_model(config).parts["transformer"].layout == ("comfyui" if prefix else "wan")
    loaded = WanBaseModelLoader().load(config).transformer
    folder = WanVACETransformer3DModel.from_pretrained(vace, subfolder="transformer").eval()
    assert loaded.config.vace_layers == [0, 2]
    inputs = _inputs(dict(folder.config), seed=3)
    torch.testing.assert_close(_forward(loaded, inputs), _forward(folder, inputs), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def vace_fp8_files(vace, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The tiny VACE transformer as ComfyUI's fp8 single files hold it (original names under
    `model.diffusion_model.`): `fp8_scaled` (Comfy-Org's released `*_fp8_scaled.safetensors`: `scale_weight` +
    `scaled_fp8` marker), `mixed` (what ComfyUI writes today: `weight_scale` + `comfy_quant`) and `fp8_e4m3fn`
    (float8 weights, no scales); every Linear weight of the base and the VACE blocks in float8 (comfy/ops.py
    quantises each Linear of comfy/ldm/wan/model.py `VaceWanModel`, whose `vace_blocks` are `WanAttentionBlock`s
    plus the `before_proj` / `after_proj` Linears). Each with the float32 state (diffusers names) it stands for."""
    from modules.util.lora.keys import original_to_diffusers_state_dict
    from modules.util.tiny_model_files import to_comfy_mixed_precision
    from tests.wan_file_layouts import dequantised, to_fp8_scaled
    root = tmp_path_factory.mktemp("vace-fp8")
    original = transformer_to_original(_state(vace, "transformer"), prefix=COMFY_PREFIX)
    scaled = to_fp8_scaled(original)
    assert scaled[COMFY_PREFIX + "vace_blocks.0.before_proj.weight"].dtype == torch.float8_e4m3fn
    mixed, metadata = to_comfy_mixed_precision(scaled)
    e4m3fn = {k: v.to(torch.float8_e4m3fn) if k.removeprefix(COMFY_PREFIX).startswith(("blocks.", "vace_blocks."))
              and v.dim() == 2 else v.to(torch.bfloat16) for k, v in original.items()}
    # a float8 layer without scales keeps its bias in float8 too: so diffusers' layerwise casting stores a layer
    # (and ComfyUI builds the Linears of an fp8_e4m3fn model in that dtype), so the reference rounds it the same way
    fp8_layers = {k.removesuffix(".weight") for k, v in e4m3fn.items() if v.dtype == torch.float8_e4m3fn}
    e4m3fn_weights = {k: (v.to(torch.float8_e4m3fn) if k.removesuffix(".bias") in fp8_layers else v).float()
                      for k, v in e4m3fn.items()}
    files = {}
    for name, tensors, meta, weights in (("fp8_scaled", scaled, None, dequantised(scaled)),
                                         ("mixed", mixed, metadata, dequantised(scaled)),
                                         ("fp8_e4m3fn", e4m3fn, None, e4m3fn_weights)):
        path = root / f"wan2.1_vace_1.3B_{name}.safetensors"
        save_file(tensors, str(path), metadata=meta or None)
        files[name] = path, original_to_diffusers_state_dict(weights)
    return files


@pytest.mark.parametrize("name", ["fp8_scaled", "mixed", "fp8_e4m3fn"])
def test_a_comfyui_fp8_single_file_keeps_float8_and_computes_what_the_folder_computes(vace, vace_fp8_files, name):
    """Loaded for sampling in fp8 (bfloat16 compute), the file's model equals the diffusers-folder model holding
    the same float8 numbers (times their scales) in bfloat16, the VACE blocks included."""
    from modules.util.enum.DataType import DataType
    path, weights = vace_fp8_files[name]
    part = {"path": str(path), "weight_dtype": DataType.FLOAT_8 if name != "fp8_e4m3fn" else DataType.BFLOAT_16}
    config = ModelConfig(base_model_name=str(vace), transformer=part)
    found = plan_model(config).parts["transformer"]
    assert (found.layout, found.dtype) == ("comfyui", "fp8_scaled" if name != "fp8_e4m3fn" else "fp8_e4m3fn")
    loaded = WanBaseModelLoader().load(config).transformer
    for layer in (loaded.blocks[0].attn1.to_q, loaded.vace_blocks[0].proj_in, loaded.vace_blocks[1].attn2.to_k):
        assert layer.weight.dtype == torch.float8_e4m3fn   # not upcast in memory
    # bfloat16 compute with the float32 modules diffusers keeps (norms, time embedder), as the loader builds it
    folder = WanVACETransformer3DModel.from_pretrained(vace, subfolder="transformer", torch_dtype=torch.bfloat16)
    folder.eval().load_state_dict(weights)
    inputs = {k: v.to(torch.bfloat16) for k, v in _inputs(dict(folder.config), seed=5).items()}
    expected = _forward(folder, inputs)
    # scaled layers dequantise in bfloat16 per call (the reference once in float32): within a bfloat16 step; the
    # unscaled fp8 layers upcast exactly as the reference's rounded weights
    tolerance = 0 if name == "fp8_e4m3fn" else 2e-2
    torch.testing.assert_close(_forward(loaded, inputs), expected, atol=tolerance, rtol=tolerance)


def test_a_vace_fun_a14b_pair_of_fp8_scaled_files_computes_what_each_folder_expert_computes(tiny_model, tmp_path):
    """Wan2.2-VACE-Fun A14B as ComfyUI holds it: one fp8_scaled file per expert (model.transformer.path and
    model.transformer_2.path); each expert equals the folder's with the same dequantised weights."""
    from modules.util.enum.DataType import DataType
    from modules.util.lora.keys import original_to_diffusers_state_dict
    from tests.wan_file_layouts import dequantised, to_fp8_scaled
    base = tiny_model("wan2.2-vace-fun-a14b")
    parts, weights = {}, {}
    for part in ("transformer", "transformer_2"):
        scaled = to_fp8_scaled(transformer_to_original(_state(base, part), prefix=COMFY_PREFIX))
        path = tmp_path / f"wan2.2_fun_vace_{'high' if part == 'transformer' else 'low'}_noise_fp8_scaled.safetensors"
        save_file(scaled, str(path))
        parts[part] = {"path": str(path), "weight_dtype": DataType.FLOAT_8}
        weights[part] = original_to_diffusers_state_dict(dequantised(scaled))
    config = ModelConfig(base_model_name=str(base), **parts)
    plan = plan_model(config)
    assert plan.variant is WanVariant.VACE_A14B
    assert [(plan.parts[p].layout, plan.parts[p].dtype) for p in parts] == [("comfyui", "fp8_scaled")] * 2
    model = WanBaseModelLoader().load(config)
    for part in parts:
        loaded = getattr(model, part)
        assert loaded.vace_blocks[0].proj_in.weight.dtype == torch.float8_e4m3fn
        folder = WanVACETransformer3DModel.from_pretrained(base, subfolder=part, torch_dtype=torch.bfloat16)
        folder.eval().load_state_dict(weights[part])
        inputs = {k: v.to(torch.bfloat16) for k, v in _inputs(dict(folder.config), seed=6).items()}
        torch.testing.assert_close(_forward(loaded, inputs), _forward(folder, inputs), atol=2e-2, rtol=2e-2)
