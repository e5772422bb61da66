"""LoRA file formats (modules/util/lora/formats.py, apply.py) on tiny real Wan transformers with peft adapters,
with diffusers' own `WanPipeline.load_lora_weights` as a peer reading our files."""
import copy
import itertools
import json
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # in case pytest.ini's pythonpath is absent

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import save_file

from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.apply import load_lora_weights_into_peft, lora_weights_from_peft, merge_lora
from modules.util.lora.formats import (LoraMatchError, LoraModule, expert_lora_paths, load_lora_file,
                                       lora_from_state_dict, lora_to_state_dict, match_to_model, save_lora_file)
from modules.util.lora.keys import diffusers_module_to_original

BASE = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, ffn_dim=32, text_dim=32, freq_dim=32,
            out_channels=16)
VARIANTS = {
    "i2v": dict(in_channels=36, image_dim=32, added_kv_proj_dim=16),
    "t2v": dict(in_channels=16),
}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "add_k_proj", "add_v_proj"]
RANK, ALPHA = 4, 8
FORMATS = [ModelFormat.COMFY_LORA, ModelFormat.KOHYA_LORA, ModelFormat.DIFFUSERS_LORA]
LAYOUTS = {ModelFormat.COMFY_LORA: "comfy", ModelFormat.KOHYA_LORA: "kohya", ModelFormat.DIFFUSERS_LORA: "diffusers"}
ATOL = 1e-5


def _targets(variant: str) -> list[str]:
    return TARGETS if variant == "i2v" else [t for t in TARGETS if not t.startswith("add_")]


def _randomise_adapter(model: torch.nn.Module, seed: int, dora: bool = False) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_B:
                b = module.lora_B["default"].weight
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
                if dora:
                    m = module.lora_magnitude_vector["default"].weight
                    m.mul_(1 + 0.1 * torch.randn(m.shape, generator=generator))


class Setup:
    def __init__(self, variant: str):
        torch.manual_seed(0)
        self.variant = variant
        self.base = WanTransformer3DModel(**BASE, **VARIANTS[variant]).eval()
        self.peft = copy.deepcopy(self.base)
        self.peft.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=_targets(variant)), "default")
        _randomise_adapter(self.peft, seed=1)
        self.weights = lora_weights_from_peft(self.peft)
        self.module_names = {name for name, _ in self.base.named_modules()}
        g = torch.Generator().manual_seed(2)
        channels = VARIANTS[variant]["in_channels"]
        self.inputs = dict(hidden_states=torch.randn(1, channels, 2, 4, 4, generator=g),
                           timestep=torch.tensor([500]),
                           encoder_hidden_states=torch.randn(1, 6, BASE["text_dim"], generator=g))
        if variant == "i2v":
            self.inputs["encoder_hidden_states_image"] = torch.randn(1, 3, 32, generator=g)

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> torch.Tensor:
        return model(**self.inputs, return_dict=False)[0]

    def merged(self, weights=None, strength: float = 1.0) -> torch.nn.Module:
        model = copy.deepcopy(self.base)
        merge_lora(model, self.weights if weights is None else weights, strength)
        return model


_SETUPS: dict[str, Setup] = {}


def setup(variant: str = "i2v") -> Setup:
    if variant not in _SETUPS:
        _SETUPS[variant] = Setup(variant)
    return _SETUPS[variant]


def assert_same_deltas(a: dict[str, LoraModule], b: dict[str, LoraModule]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.allclose(a[name].delta(), b[name].delta(), atol=1e-6), name
        assert (a[name].dora_scale is None) == (b[name].dora_scale is None), name
        if a[name].dora_scale is not None:
            assert torch.allclose(a[name].dora_scale.reshape(-1), b[name].dora_scale.reshape(-1)), name


# ------------------------------------------------------------------------------------------------ peft and merge
def test_peft_weights_and_merge_equal_peft_forward():
    s = setup()
    assert len(s.weights) == 2 * 12  # to_q, to_k, to_v, to_out.0 in attn1 and attn2
    assert all(m.alpha == ALPHA and m.rank == RANK for m in s.weights.values())
    assert "blocks.1.attn2.add_k_proj" in s.weights and "blocks.0.ffn.net.0.proj" in s.weights
    out_base, out_peft = s.run(s.base), s.run(s.peft)
    assert not torch.allclose(out_base, out_peft, atol=1e-3)  # the adapter does something
    assert torch.allclose(s.run(s.merged()), out_peft, atol=ATOL)


def test_merge_strength_equals_peft_scale():
    s = setup()
    scaled = copy.deepcopy(s.peft)
    for module in scaled.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", 0.5)
    assert torch.allclose(s.run(s.merged(strength=0.5)), s.run(scaled), atol=ATOL)


def test_merge_keeps_dtype_and_rejects_unknown_modules():
    s = setup()
    model = copy.deepcopy(s.base).to(torch.bfloat16)
    merge_lora(model, s.weights)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    with pytest.raises(LoraMatchError, match="blocks.7"):
        merge_lora(copy.deepcopy(s.base), {"blocks.7.attn1.to_q": s.weights["blocks.0.attn1.to_q"]})


def test_load_into_peft_with_other_alpha_rescales_b():
    s = setup()
    other = copy.deepcopy(s.base)
    other.add_adapter(LoraConfig(r=RANK, lora_alpha=2, target_modules=TARGETS), "default")
    load_lora_weights_into_peft(other, s.weights)
    assert torch.allclose(s.run(other), s.run(s.peft), atol=ATOL)
    back = lora_weights_from_peft(other)
    assert all(m.alpha == 2 for m in back.values())
    assert_same_deltas(back, s.weights)
    wrong_rank = copy.deepcopy(s.base)
    wrong_rank.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=TARGETS), "default")
    with pytest.raises(ValueError, match="rank must match"):
        load_lora_weights_into_peft(wrong_rank, s.weights)


def test_rslora_alpha():
    s = setup()
    model = copy.deepcopy(s.base)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, use_rslora=True, target_modules=["to_q"]), "default")
    _randomise_adapter(model, seed=3)
    weights = lora_weights_from_peft(model)
    assert all(math.isclose(m.scale, ALPHA / math.sqrt(RANK)) for m in weights.values())
    assert torch.allclose(s.run(s.merged(weights)), s.run(model), atol=ATOL)


# ------------------------------------------------------------------------------------------------ our formats
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_roundtrip(fmt, tmp_path):
    s = setup()
    sd = lora_to_state_dict(s.weights, fmt)
    back, layout = lora_from_state_dict(sd)
    assert layout == LAYOUTS[fmt]
    assert_same_deltas(back, s.weights)
    if fmt == ModelFormat.COMFY_LORA:
        assert "diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight" in sd
        assert "diffusion_model.blocks.1.ffn.0.lora_B.weight" in sd
    elif fmt == ModelFormat.KOHYA_LORA:
        assert "lora_unet_blocks_0_self_attn_o.lora_down.weight" in sd
    else:
        assert "transformer.blocks.0.attn2.add_v_proj.lora_B.weight" in sd
        assert all(m.alpha == RANK for m in back.values())  # alpha folded into lora_B
    alphas = [v for k, v in sd.items() if k.endswith(".alpha")]
    assert len(alphas) == (len(s.weights) if fmt != ModelFormat.DIFFUSERS_LORA else 0)
    assert all(a.dim() == 0 and a.dtype == torch.float32 and a.item() == ALPHA for a in alphas)

    path = tmp_path / "lora.safetensors"
    save_lora_file(s.weights, fmt, path, {"modelspec.title": "x"})
    loaded, layout = load_lora_file(path)
    assert layout == LAYOUTS[fmt]
    assert_same_deltas(loaded, s.weights)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["modelspec.title"] == "x"


def test_pairwise_conversion_is_lossless():
    s = setup()
    for a, b in itertools.product(FORMATS, FORMATS):
        first, _ = lora_from_state_dict(lora_to_state_dict(s.weights, a))
        second, layout = lora_from_state_dict(lora_to_state_dict(first, b))
        assert layout == LAYOUTS[b]
        assert_same_deltas(second, s.weights)


def test_save_dtype():
    s = setup()
    sd = lora_to_state_dict(s.weights, ModelFormat.COMFY_LORA, dtype=torch.bfloat16)
    assert sd["diffusion_model.blocks.0.self_attn.q.lora_A.weight"].dtype == torch.bfloat16
    assert sd["diffusion_model.blocks.0.self_attn.q.alpha"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------ peer layouts
def _peer_files(weights) -> dict[str, tuple[dict, str]]:
    """Hand-built files as the peer trainers write them, all with the same deltas as `weights`."""
    files = {k: ({}, layout) for k, layout in [
        ("musubi", "kohya"), ("musubi_rslora", "kohya"), ("diffusion-pipe", "diffusion-pipe"),
        ("ai-toolkit", "diffusion-pipe"), ("diffsynth", "diffsynth"), ("diffsynth_plain", "diffsynth"),
        ("finetrainers", "diffusers"), ("peft", "peft"), ("comfy_model_prefix", "comfy")]}
    files["musubi"][0]["use_rslora_flag"] = torch.tensor(False)
    files["musubi_rslora"][0]["use_rslora_flag"] = torch.tensor(True)
    for name, m in weights.items():
        original = diffusers_module_to_original(name)
        kohya = "lora_unet_" + original.replace(".", "_")
        folded_up = m.up * (m.alpha / m.rank)  # no alpha in the file: the scale lives in lora_B
        files["musubi"][0].update({f"{kohya}.lora_down.weight": m.down, f"{kohya}.lora_up.weight": m.up,
                                   f"{kohya}.alpha": torch.tensor(m.alpha)})
        rs_alpha = m.alpha / math.sqrt(m.rank)  # musubi RS-LoRA: scale alpha / sqrt(rank)
        files["musubi_rslora"][0].update({f"{kohya}.lora_down.weight": m.down, f"{kohya}.lora_up.weight": m.up,
                                          f"{kohya}.alpha": torch.tensor(rs_alpha)})
        for key in ("diffusion-pipe", "ai-toolkit"):
            files[key][0].update({f"diffusion_model.{original}.lora_A.weight": m.down,
                                  f"diffusion_model.{original}.lora_B.weight": folded_up})
        files["diffsynth"][0].update({f"{original}.lora_A.default.weight": m.down,
                                      f"{original}.lora_B.default.weight": folded_up})
        files["diffsynth_plain"][0].update({f"{original}.lora_A.weight": m.down,
                                            f"{original}.lora_B.weight": folded_up})
        files["finetrainers"][0].update({f"transformer.{name}.lora_A.weight": m.down,
                                         f"transformer.{name}.lora_B.weight": folded_up})
        files["peft"][0].update({f"{name}.lora_A.default.weight": m.down, f"{name}.lora_B.default.weight": folded_up})
        files["comfy_model_prefix"][0].update({
            f"model.diffusion_model.{original}.lora_down.weight": m.down,
            f"model.diffusion_model.{original}.lora_up.weight": m.up,
            f"model.diffusion_model.{original}.alpha": torch.tensor(m.alpha, dtype=torch.float16)})
    return files


def test_peer_layouts_give_the_comfy_deltas():
    s = setup()
    comfy, _ = lora_from_state_dict(lora_to_state_dict(s.weights, ModelFormat.COMFY_LORA))
    for peer, (sd, expected_layout) in _peer_files(s.weights).items():
        weights, layout = lora_from_state_dict(sd)
        assert layout == expected_layout, peer
        assert_same_deltas(weights, comfy)
        resolved, _ = lora_from_state_dict(sd, module_names=s.module_names)
        assert_same_deltas(resolved, comfy)


def test_diffusers_adapter_metadata_alpha(tmp_path):
    """diffusers' save_lora_weights keeps lora_B raw and records lora_alpha in the `lora_adapter_metadata` header."""
    s = setup()
    sd = {}
    for name, m in s.weights.items():
        sd[f"transformer.{name}.lora_A.weight"] = m.down
        sd[f"transformer.{name}.lora_B.weight"] = m.up
    header = {"transformer.r": RANK, "transformer.lora_alpha": ALPHA, "transformer.alpha_pattern": {"to_q": 4}}
    path = tmp_path / "pytorch_lora_weights.safetensors"
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(header)})
    weights, layout = load_lora_file(path)
    assert layout == "diffusers"
    assert weights["blocks.0.attn1.to_q"].alpha == 4 and weights["blocks.0.attn1.to_k"].alpha == ALPHA


# ------------------------------------------------------------------------------------------------ matching
def test_match_partial_warns_with_count(caplog):
    s = setup()
    t2v_names = {name for name, _ in setup("t2v").base.named_modules()}
    weights, _ = lora_from_state_dict(lora_to_state_dict(s.weights, ModelFormat.KOHYA_LORA))
    with caplog.at_level(logging.WARNING, logger="modules.util.lora.formats"):
        matched = match_to_model(weights, t2v_names)
    assert len(matched) == len(weights) - 4  # add_k_proj / add_v_proj in 2 blocks
    assert any("4 of 24 modules" in r.getMessage() for r in caplog.records)


def test_match_nothing_raises_with_keys():
    s = setup()
    sd = {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8),
          "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4)}
    weights, layout = lora_from_state_dict(sd)
    assert layout == "kohya" and list(weights) == ["lora_te_text_model_encoder_layers_0_mlp_fc1"]
    with pytest.raises(LoraMatchError, match="lora_te_text_model_encoder_layers_0_mlp_fc1"):
        match_to_model(weights, s.module_names)
    deeper = {f"diffusion_model.blocks.9.self_attn.q.lora_{x}.weight": torch.zeros(4, 4) for x in "AB"}
    with pytest.raises(LoraMatchError, match="blocks.9.attn1.to_q"):
        match_to_model(lora_from_state_dict(deeper)[0], s.module_names)


def test_expert_paths():
    high, low = expert_lora_paths("/out/my_lora.safetensors")
    assert (str(high), str(low)) == ("/out/my_lora_high_noise.safetensors", "/out/my_lora_low_noise.safetensors")
    assert expert_lora_paths("/out/my_lora")[0].name == "my_lora_high_noise.safetensors"


# ------------------------------------------------------------------------------------------------ DoRA, Conv3d
def test_dora_formats_merge_and_peft():
    s = setup()
    model = copy.deepcopy(s.base)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, use_dora=True, target_modules=["to_q", "ffn.net.2"]),
                      "default")
    _randomise_adapter(model, seed=4, dora=True)
    weights = lora_weights_from_peft(model)
    assert weights["blocks.0.attn1.to_q"].dora_scale.shape == (16, 1)
    assert torch.allclose(s.run(s.merged(weights)), s.run(model), atol=ATOL)
    assert "diffusion_model.blocks.0.self_attn.q.dora_scale" in lora_to_state_dict(weights, ModelFormat.COMFY_LORA)
    for fmt in FORMATS:
        back, _ = lora_from_state_dict(lora_to_state_dict(weights, fmt))
        assert_same_deltas(back, weights)
    musubi = {"use_dora_flag": torch.tensor(True)}  # musubi-tuner's DoRA: magnitude as `dora_layer.weight` (out,)
    for name, m in weights.items():
        kohya = "lora_unet_" + diffusers_module_to_original(name).replace(".", "_")
        musubi.update({f"{kohya}.lora_down.weight": m.down, f"{kohya}.lora_up.weight": m.up,
                       f"{kohya}.alpha": torch.tensor(m.alpha), f"{kohya}.dora_layer.weight": m.dora_scale.reshape(-1)})
    assert_same_deltas(lora_from_state_dict(musubi)[0], weights)
    other = copy.deepcopy(s.base)
    other.add_adapter(LoraConfig(r=RANK, lora_alpha=1, use_dora=True, target_modules=["to_q", "ffn.net.2"]), "default")
    load_lora_weights_into_peft(other, weights)
    assert torch.allclose(s.run(other), s.run(model), atol=ATOL)


def test_conv3d_patch_embedding():
    s = setup()
    model = copy.deepcopy(s.base)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["patch_embedding", "proj_out"]), "default")
    _randomise_adapter(model, seed=5)
    weights = lora_weights_from_peft(model)
    assert weights["patch_embedding"].down.dim() == 5
    assert torch.allclose(s.run(s.merged(weights)), s.run(model), atol=ATOL)
    for fmt in FORMATS:
        back, _ = lora_from_state_dict(lora_to_state_dict(weights, fmt))
        assert_same_deltas(back, weights)
    assert "lora_unet_head_head.lora_up.weight" in lora_to_state_dict(weights, ModelFormat.KOHYA_LORA)


# ------------------------------------------------------------------------------------------------ diffusers peer
@pytest.mark.parametrize("variant", ["t2v", "i2v"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_diffusers_pipeline_reads_our_files(fmt, variant, tmp_path):
    s = setup(variant)
    path = tmp_path / "lora.safetensors"
    save_lora_file(s.weights, fmt, path)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=copy.deepcopy(s.base))
    pipe.load_lora_weights(str(path), adapter_name="ours")
    out = s.run(pipe.transformer)
    assert not torch.allclose(out, s.run(s.base), atol=1e-3)  # the LoRA was applied
    assert torch.allclose(out, s.run(s.merged()), atol=ATOL)
    pipe.set_adapters(["ours"], [0.5])
    assert torch.allclose(s.run(pipe.transformer), s.run(s.merged(strength=0.5)), atol=ATOL)
