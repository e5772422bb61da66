"""The model tab's part pickers (toolkit-free controller): what a chosen file holds, shown before Start."""
import torch
from safetensors.torch import load_file, save_file

from modules.ui.TrainController import TrainController
from modules.ui.model_parts import describe_model_part, describe_part
from tests.wan_file_layouts import COMFY_PREFIX, to_fp8_scaled, transformer_to_original, vae21_to_original


def test_each_part_path_is_described_by_its_content(tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")
    state = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))
    transformer = tmp_path / "whatever_name.safetensors"
    save_file(to_fp8_scaled(transformer_to_original(state, prefix=COMFY_PREFIX)), str(transformer))
    vae = tmp_path / "Wan2.1_VAE.pth"
    torch.save(vae21_to_original(load_file(str(base / "vae" / "diffusion_pytorch_model.safetensors"))), vae)

    assert describe_part(str(transformer)) == "transformer: comfyui, fp8_scaled"
    assert describe_part(str(vae)) == "vae: wan2.1, fp32"
    junk = tmp_path / "notes.safetensors"
    save_file({"x": torch.zeros(2)}, str(junk))
    assert describe_part(str(junk)).startswith(f"not usable: {junk}: holds no Wan model part")
    assert describe_part(str(base / "transformer")) == "transformer: diffusers, fp32"

    controller = TrainController(last_used=tmp_path / "last_used.json")
    controller.state.set("model.base_model_name", str(base))
    assert describe_model_part(controller.state, "vae") == "(from the base model)"
    controller.state.set("model.transformer.path", str(transformer))
    controller.state.set("model.vae.path", str(vae))
    assert describe_model_part(controller.state, "transformer") == "transformer: comfyui, fp8_scaled"
    assert controller.detect_variant() == "Wan 2.1 T2V (T2V), from files"
    controller.state.set("model.vae.path", str(transformer))
    assert controller.detect_variant().startswith("not a Wan model: model.vae.path: ")
