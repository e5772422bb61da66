"""DoRA and LoKr on the VACE blocks (`lora.targets: vace`) train with controls, masks and references; the saved file
names only VACE blocks, our sampler's output with the adapter differs from the base model's, and the file merged into a
fresh base gives the live adapter's output. A LoKr file gets no DIFFUSERS_LORA companion (diffusers has no names for
it): writing one failed the save at the end of the run."""
import pytest
import torch
from safetensors import safe_open

from learning import train
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.modelSampler.sampling_io import apply_lora_files
from modules.util.config.ModelConfig import ModelConfig
from modules.util.lora.format_notes import format_notes
from test_vace_training import _sample, vace_dataset

KINDS = {"DORA": ["lora.dora=true"], "LOKR": ["lora.type=LOKR"]}
ROLE = {"DORA": "dora_scale", "LOKR": "lokr_w1"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_adapter_on_the_vace_blocks_trains_saves_and_changes_the_sample(kind, tiny_model, tmp_path):
    folder = tiny_model("wan2.1-vace")
    data = vace_dataset(tmp_path / "data", count=2)
    trainer = train(tmp_path, folder, data, steps=2,
                    overrides=["optimizer.learning_rate=0.05", "lora.rank=4", "lora.alpha=8", "lora.targets=vace",
                               "batch_size=2", *KINDS[kind]])
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and all(key.startswith("diffusion_model.vace_blocks.") for key in keys)
    assert f"diffusion_model.vace_blocks.1.self_attn.q.{ROLE[kind]}" in keys
    # DoRA is a LoRA: WanVACEPipeline gets its DIFFUSERS_LORA file beside it; LoKr has no diffusers names, so none
    assert (tmp_path / "out.diffusers.safetensors").exists() == (kind == "DORA")
    notes = format_notes("LORA", "COMFY_LORA", "LOKR" if kind == "LOKR" else "LORA", kind == "DORA", "vace")
    assert any("<name>.diffusers.safetensors" in note for note in notes) == (kind == "DORA")
    for part in trainer.model.parts().values():
        part.eval()
    live = WanModelSampler(trainer.model, device="cpu").sample(_sample(data)).latents
    base = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))
    before = WanModelSampler(base, device="cpu").sample(_sample(data)).latents
    assert (live - before).abs().max() > 1e-3   # the adapter changes the output
    apply_lora_files(base, [(tmp_path / "out.safetensors", 1.0)])
    merged = WanModelSampler(base, device="cpu").sample(_sample(data)).latents
    torch.testing.assert_close(merged, live, rtol=0, atol=1e-5)
