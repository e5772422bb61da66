"""LoHa and LoKr adapters (lora.type LOHA / LOKR): a short training writes the LyCORIS key names ComfyUI reads
(comfy/weight_adapter/loha.py, lokr.py) under the COMFY and KOHYA prefixes; every module's file delta is peft's
`get_delta_weight`, and the file merged into a fresh base gives the live adapter's outputs. DIFFUSERS_LORA refuses
them. Peft layers of every LoKr factor structure go through a file and back into an adapter unchanged."""
import dataclasses

import pytest
import torch
from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model
from pydantic import ValidationError
from safetensors import safe_open

from learning import train
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.sampling_io import apply_lora_files
from modules.util.config.MethodConfig import LoraConfig
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.apply import (is_adapter_parameter, load_lora_weights_into_peft, lora_weights_from_peft,
                                     merge_lora)
from modules.util.lora.formats import load_lora_file, lora_from_state_dict, lora_to_state_dict, match_to_model
from modules.util.lora.lycoris import HADA_ROLES, LOKR_ROLES, LohaModule, LokrModule

T2V = "wan2.1-t2v"
# rank 4 on the tiny model's 64-wide attention and 256-wide FFN: LoKr keeps both Kronecker factors full on the
# attention (peft's alpha / r then folds into lokr_w1) and factorises w2 on the FFN; alpha != rank
TRAINING = ["optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=8"]
PREFIXES = {ModelFormat.COMFY_LORA: "diffusion_model.", ModelFormat.KOHYA_LORA: "lora_unet_"}
LAYOUTS = {ModelFormat.COMFY_LORA: "comfy", ModelFormat.KOHYA_LORA: "kohya"}
SPOT = {(ModelFormat.COMFY_LORA, "LOHA"): "diffusion_model.blocks.0.self_attn.q.hada_w1_a",
        (ModelFormat.KOHYA_LORA, "LOHA"): "lora_unet_blocks_0_self_attn_q.hada_w1_a",
        (ModelFormat.COMFY_LORA, "LOKR"): "diffusion_model.blocks.0.self_attn.q.lokr_w1",
        (ModelFormat.KOHYA_LORA, "LOKR"): "lora_unet_blocks_0_ffn_0.lokr_w2_a"}
ROLES = {"LOHA": HADA_ROLES, "LOKR": LOKR_ROLES}


class Trained:
    def __init__(self, trainer, tmp):
        self.trainer, self.model = trainer, trainer.model
        for part in self.model.parts().values():
            part.eval()
        self.paths = {ModelFormat.COMFY_LORA: tmp / "out.safetensors",
                      ModelFormat.KOHYA_LORA: tmp / "kohya.safetensors"}
        trainer.setup.save_result(str(self.paths[ModelFormat.KOHYA_LORA]), ModelFormat.KOHYA_LORA, torch.float32, None)

    def peft_layers(self) -> dict[str, torch.nn.Module]:
        return {name: m for name, m in self.model.transformer.named_modules() if hasattr(m, "get_delta_weight")}


@pytest.fixture(scope="module")
def trained(tiny_model, squares_dataset, tmp_path_factory):
    done: dict[str, Trained] = {}

    def get(kind: str) -> Trained:
        if kind not in done:
            tmp = tmp_path_factory.mktemp(f"train-{kind}")
            trainer = train(tmp, tiny_model(T2V), squares_dataset, steps=3,
                            overrides=[*TRAINING, f"lora.type={kind}"])
            done[kind] = Trained(trainer, tmp)
        return done[kind]

    return get


def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


@pytest.mark.parametrize("fmt", list(PREFIXES), ids=str)
@pytest.mark.parametrize("kind", ["LOHA", "LOKR"])
def test_file_has_lycoris_names_and_peft_deltas(kind, fmt, trained):
    trained = trained(kind)
    tensors = read_tensors(trained.paths[fmt])
    assert SPOT[fmt, kind] in tensors
    for key in tensors:
        assert key.startswith(PREFIXES[fmt]), key
        assert key.rsplit(".", 1)[1] in (*ROLES[kind], "alpha"), key
    layers = trained.peft_layers()
    # attn-mlp on 2 blocks: 4 attn1 + 4 attn2 + 2 ffn each
    assert sum(key.endswith(".alpha") for key in tensors) == len(layers) == 2 * 10
    weights, layout = load_lora_file(trained.paths[fmt])
    assert layout == LAYOUTS[fmt]
    weights = match_to_model(weights, [name for name, _ in trained.model.transformer.named_modules()])
    assert weights.keys() == layers.keys()
    expected_type = LohaModule if kind == "LOHA" else LokrModule
    with torch.no_grad():
        for name, layer in layers.items():
            assert isinstance(weights[name], expected_type)
            peft_delta = layer.get_delta_weight("default")
            assert peft_delta.abs().max() > 0, name  # trained away from the zero init
            torch.testing.assert_close(weights[name].delta(), peft_delta, atol=1e-6, rtol=0, msg=name)
    if kind == "LOKR":  # both structures occur: full-full (scale 1, alpha = rank) and w2 factorised (alpha / r)
        q, ffn = weights["blocks.0.attn1.to_q"], weights["blocks.0.ffn.net.0.proj"]
        assert q.rank is None and q.scale == 1.0 and q.alpha == 4.0
        assert ffn.lokr_w2_a is not None and ffn.rank == 4 and ffn.alpha == 8.0
    else:
        assert all(module.alpha == 8.0 and module.rank == 4 for module in weights.values())


@pytest.mark.parametrize("kind", ["LOHA", "LOKR"])
def test_merged_file_gives_the_live_adapter_outputs(kind, trained, tiny_model):
    trained = trained(kind)   # trains on first use: outside no_grad
    assert all(is_adapter_parameter(name.split(".", 1)[1]) for name in trained.trainer.setup.trainable_state_dict())
    with torch.no_grad():
        _check_merged_outputs(trained, tiny_model)


def _check_merged_outputs(trained, tiny_model):
    generator = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=generator), return_dict=False)
    live = trained.model.transformer(**inputs)[0]

    base = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model(T2V))))
    base.transformer.eval()
    plain = base.transformer(**inputs)[0]
    assert (live - plain).abs().max() > 1e-4  # the adapter changes the output
    apply_lora_files(base, [(trained.paths[ModelFormat.COMFY_LORA], 1.0)])  # load_lora_file + merge_lora
    torch.testing.assert_close(base.transformer(**inputs)[0], live, atol=1e-5, rtol=0)

    kohya = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model(T2V)))).transformer.eval()
    weights, _ = load_lora_file(trained.paths[ModelFormat.KOHYA_LORA])
    merge_lora(kohya, match_to_model(weights, [n for n, _ in kohya.named_modules()]))
    torch.testing.assert_close(kohya(**inputs)[0], live, atol=1e-5, rtol=0)


def test_diffusers_format_is_a_clear_error(trained, tmp_path):
    trained = trained("LOHA")
    with pytest.raises(ValueError, match="DIFFUSERS_LORA cannot hold LoHa.*COMFY_LORA"):
        lora_to_state_dict(lora_weights_from_peft(trained.model.transformer), ModelFormat.DIFFUSERS_LORA)
    with pytest.raises(ValueError, match="LOHA cannot be saved as DIFFUSERS_LORA.*COMFY_LORA"):
        trained.trainer.setup.save_result(str(tmp_path / "x.safetensors"), ModelFormat.DIFFUSERS_LORA, None, None)
    assert not (tmp_path / "x.safetensors").exists()


def test_dora_needs_lora_type():
    with pytest.raises(ValidationError, match="DoRA is available with lora.type LORA only"):
        LoraConfig(type="LOKR", dora=True)


# -------------------------------------------------------------------------- every factor structure, without training

def linear_with(config) -> torch.nn.Module:
    model = torch.nn.Sequential()
    model.add_module("l", torch.nn.Linear(64, 96))  # LoKr factors: out 96 = 8 x 12, in 64 = 8 x 8
    return inject_adapter_in_model(config, model, "default")


STRUCTURES = {  # peft config -> the LoKr factors it makes on a 96 x 64 Linear
    "loha": (LoHaConfig(r=4, alpha=8, target_modules=["l"], init_weights=False), HADA_ROLES[:4]),
    "lokr-full": (LoKrConfig(r=8, alpha=2, target_modules=["l"], init_weights=False), ("lokr_w1", "lokr_w2")),
    "lokr-w2": (LoKrConfig(r=2, alpha=8, target_modules=["l"], init_weights=False),
                ("lokr_w1", "lokr_w2_a", "lokr_w2_b")),
    "lokr-both": (LoKrConfig(r=2, alpha=8, target_modules=["l"], init_weights=False, decompose_both=True),
                  ("lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")),
}


@pytest.mark.parametrize("structure", list(STRUCTURES))
@torch.no_grad()
def test_peft_factors_through_a_file_and_back(structure):
    config, roles = STRUCTURES[structure]
    torch.manual_seed(0)
    source = linear_with(config)
    expected = source.l.get_delta_weight("default")
    weights = lora_weights_from_peft(source)
    assert tuple(weights["l"].factors()) == roles
    torch.testing.assert_close(weights["l"].delta(), expected, atol=1e-6, rtol=0)
    # the file's tensors as ComfyUI names them, read back: same delta at a strength too
    state = lora_to_state_dict({"blocks.0.attn1.to_q": weights["l"]}, ModelFormat.COMFY_LORA)
    assert set(state) == {f"diffusion_model.blocks.0.self_attn.q.{r}" for r in (*roles, "alpha")}
    back, layout = lora_from_state_dict(state)
    assert layout == "comfy"
    torch.testing.assert_close(back["blocks.0.attn1.to_q"].delta(0.5), expected * 0.5, atol=1e-6, rtol=0)
    # into a fresh adapter of another alpha (lora.init_from): its delta becomes the file's
    target = linear_with(dataclasses.replace(config, alpha=3.0, init_weights=True))
    load_lora_weights_into_peft(target, {"l": back["blocks.0.attn1.to_q"]})
    torch.testing.assert_close(target.l.get_delta_weight("default"), expected, atol=1e-6, rtol=0)
    # merging equals the adapter's forward
    x = torch.randn(3, 64)
    live = source(x)
    plain = torch.nn.Linear(64, 96)
    plain.load_state_dict(source.l.base_layer.state_dict())
    merged = torch.nn.Sequential()
    merged.add_module("l", plain)
    merge_lora(merged, {"l": back["blocks.0.attn1.to_q"]})
    torch.testing.assert_close(merged(x), live, atol=1e-5, rtol=0)


def test_kind_mismatch_with_the_adapter_is_an_error():
    loha = lora_weights_from_peft(linear_with(STRUCTURES["loha"][0]))
    with pytest.raises(ValueError, match="LOHA module but the adapter is LOKR"):
        load_lora_weights_into_peft(linear_with(STRUCTURES["lokr-w2"][0]), loha)
