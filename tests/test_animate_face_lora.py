"""A LoRA over Wan2.2-Animate's face adapter (lora.face_adapter): its COMFY file names the face adapter as the
official code and ComfyUI do (key and value stacked in `linear1_kv`), and merging it as ComfyUI merges a LoRA
(weight += up @ down * alpha / rank) gives exactly the trained weights in the official layout; the same adapter read
back and written in diffusers' names loads in `WanAnimatePipeline.load_lora_weights` and changes the output exactly
as the trained model's. The motion and face encoders stay frozen."""
import json
from pathlib import Path

import pytest
import torch
from diffusers import WanAnimatePipeline

from modules.modelLoader.wan.parts.animate_files import diffusers_to_official
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import load_lora_file, save_lora_file
from tests.test_animate_training import _inputs, train_lora_briefly

OFFICIAL = json.loads((Path(__file__).parent / "fixtures" / "official_animate_key_names.json").read_text())
OFFICIAL_SHAPES = next(value for key, value in OFFICIAL.items() if not key.startswith("_"))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    return train_lora_briefly(tmp_path_factory.mktemp("animate-face-lora"), tiny_model("wan2.2-animate"),
                              ["lora.alpha=2", "lora.face_adapter=true"])


def _effective(module) -> torch.Tensor:
    """The weight a peft LoRA Linear computes with: base + B @ A * scaling."""
    return (module.base_layer.weight + module.lora_B["default"].weight @ module.lora_A["default"].weight
            * module.scaling["default"]).detach()


def test_only_the_blocks_and_the_face_adapter_train(trained):
    trainer, _ = trained
    trained_names = {name for name, p in trainer.model.transformer.named_parameters() if p.requires_grad}
    assert any(name.startswith("face_adapter.0.to_k.lora_A") for name in trained_names)
    assert not any(name.startswith(("motion_encoder.", "face_encoder.")) for name in trained_names)


def test_comfy_file_merges_as_comfyui_merges_it_into_the_official_weights(trained, tiny_model):
    trainer, lora = trained
    from safetensors.torch import load_file
    tensors = load_file(str(lora))
    stems = {key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for key in tensors if "lora_A" in key}
    face = sorted(stem for stem in stems if stem.startswith("face_adapter."))
    assert face == ["face_adapter.fuser_blocks.0.linear1_kv", "face_adapter.fuser_blocks.0.linear1_q",
                    "face_adapter.fuser_blocks.0.linear2"]
    base = WanAnimatePipeline.from_pretrained(tiny_model("wan2.2-animate"), torch_dtype=torch.float32).transformer
    official = diffusers_to_official(base.state_dict())
    for stem in stems:   # every LoRA'd module is a weight of the official model, of the shape up @ down makes
        down, up = tensors[f"diffusion_model.{stem}.lora_A.weight"], tensors[f"diffusion_model.{stem}.lora_B.weight"]
        assert list(OFFICIAL_SHAPES[f"{stem}.weight"]) == [up.shape[0], down.shape[1]], stem
        alpha = tensors[f"diffusion_model.{stem}.alpha"].item()
        official[f"{stem}.weight"] = official[f"{stem}.weight"] + up @ down * alpha / down.shape[0]
    adapter = trainer.model.transformer.face_adapter[0]
    torch.testing.assert_close(official["face_adapter.fuser_blocks.0.linear1_kv.weight"],
                               torch.cat([_effective(adapter.to_k), _effective(adapter.to_v)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(official["face_adapter.fuser_blocks.0.linear2.weight"], _effective(adapter.to_out),
                               rtol=0, atol=1e-6)


def test_face_adapter_lora_loads_in_the_pipeline_exactly(trained, tiny_model, tmp_path):
    trainer, lora = trained
    weights, layout = load_lora_file(lora)
    assert layout == "comfy" and {"face_adapter.0.to_k", "face_adapter.0.to_v"} <= set(weights)
    diffusers_file = tmp_path / "diffusers.safetensors"
    save_lora_file(weights, ModelFormat.DIFFUSERS_LORA, diffusers_file)
    ours = trainer.model.transformer
    ours.eval()
    outputs = {}
    for name, drop_face in (("all", False), ("blocks only", True)):
        pipe = WanAnimatePipeline.from_pretrained(tiny_model("wan2.2-animate"), torch_dtype=torch.float32)
        file = diffusers_file
        if drop_face:
            file = tmp_path / "blocks.safetensors"
            save_lora_file({k: v for k, v in weights.items() if not k.startswith("face_adapter.")},
                           ModelFormat.DIFFUSERS_LORA, file)
        pipe.load_lora_weights(str(file))
        with torch.no_grad():
            outputs[name] = pipe.transformer(**_inputs(pipe.transformer)).sample
    with torch.no_grad():
        trained_output = ours(**_inputs(ours)).sample
    torch.testing.assert_close(outputs["all"], trained_output, rtol=0, atol=1e-5)
    assert (outputs["blocks only"] - trained_output).abs().max() > 1e-4   # the face adapter's part counts


def test_face_adapter_needs_an_animate_model_and_lora(tiny_model, tmp_path):
    from modules.util.config.ConfigError import ConfigError
    from modules.util.config.config_io import load_config
    from modules.trainer.prepare import prepare_config
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}", "lora.face_adapter=true",
                                    f'data.concepts=[{{"path": "{tmp_path}"}}]', "device=cpu"])
    with pytest.raises(ConfigError, match="lora.face_adapter: the transformer has no face adapter"):
        prepare_config(config)
    with pytest.raises(ConfigError, match="lora.face_adapter: .* use lora.type LORA"):
        load_config(overrides=["lora.face_adapter=true", "lora.type=LOKR"])
