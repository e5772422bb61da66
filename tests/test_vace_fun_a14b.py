"""Wan 2.2 VACE-Fun A14B: a LoRA on both experts' VACE blocks (`expert: both`) trains with controls, writes one file
per expert, and our sampler with a control video uses each: the high-noise file changes the output, and the
low-noise file changes it further."""
import torch
from safetensors import safe_open

from learning import train
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.modelSampler.sampling_io import apply_lora_files
from modules.util.config.ModelConfig import ModelConfig
from modules.util.expert_metadata import EXPERT_METADATA
from modules.util.lora.apply import lora_weights_from_peft
from modules.util.lora.formats import expert_lora_paths
from test_vace_training import _sample, vace_dataset


def test_a_vace_fun_a14b_lora_trains_both_experts_and_the_sampler_uses_each_file(tiny_model, tmp_path):
    folder = tiny_model("wan2.2-vace-fun-a14b")
    data = vace_dataset(tmp_path / "data", count=2)
    # uniform_shift 12 routes a step to the high-noise expert 63 % of the time (plain uniform: 12.5 % above the 0.875
    # boundary); the run's seed (42) routes its two steps one to each expert
    trainer = train(tmp_path, folder, data, steps=2,
                    overrides=["optimizer.learning_rate=0.05", "lora.rank=4", "lora.alpha=8", "lora.targets=vace",
                               "batch_size=2", "expert=both", "timestep.distribution=uniform_shift",
                               "timestep.shift=12", "seed=42"])
    for expert in ("transformer", "transformer_2"):
        weights = lora_weights_from_peft(getattr(trainer.model, expert))
        assert weights and all(name.startswith("vace_blocks.") for name in weights)
        assert all(module.up.abs().sum() > 0 for module in weights.values()), expert   # both experts trained
    high, low = expert_lora_paths(tmp_path / "out.safetensors")
    for path, side in ((high, "high"), (low, "low")):
        with safe_open(str(path), "pt") as f:
            assert all(key.startswith("diffusion_model.vace_blocks.") for key in f.keys())
            assert f.metadata()[EXPERT_METADATA] == side
            assert f.metadata()["modelspec.architecture"].endswith("/lora")

    def sample(*files) -> torch.Tensor:
        model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))
        if files:
            apply_lora_files(model, [(file, 1.0) for file in files])
        # 2 steps: the first at sigma 1 (high-noise expert), the second below the boundary (low-noise expert)
        return WanModelSampler(model, device="cpu").sample(_sample(data)).latents

    base, high_only, both = sample(), sample(high), sample(tmp_path / "out.safetensors")
    assert (high_only - base).abs().max() > 1e-3   # the high-noise file reaches the high-noise expert
    assert (both - high_only).abs().max() > 1e-3   # the bare name adds the low-noise file to the low-noise expert
    torch.testing.assert_close(sample(high, low), both, rtol=0, atol=1e-6)
