"""The output's file name is the one the user gave when it already says which Wan 2.2 A14B expert it holds
(before: `expert=high` with `high.safetensors` wrote `high_high_noise.safetensors`), and the plan names the files
really written."""
from pathlib import Path

from learning import train
from modules.util.expert_metadata import recorded_expert
from modules.util.lora.formats import expert_output_paths, names_expert


def test_a_name_that_says_its_expert_is_kept(tiny_model, squares_dataset, tmp_path, capsys):
    destination = tmp_path / "high.safetensors"
    train(tmp_path, tiny_model("wan2.2-t2v-a14b"), squares_dataset, steps=1,
          overrides=["expert=high", f"output.destination={destination}"])
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["high.safetensors"]
    assert recorded_expert(destination)[0] == "high"  # the sampler puts it into the high-noise expert by its header
    assert f"output: {destination} (COMFY_LORA)\n" in capsys.readouterr().out


def test_which_names_say_their_expert():
    for name in ("high", "wan_high_noise", "my-LoRA-High-Noise", "a.high"):
        assert names_expert(f"/out/{name}.safetensors", "high"), name
    for name in ("lora", "highway", "high_quality", "low"):
        assert not names_expert(f"/out/{name}.safetensors", "high"), name
    assert expert_output_paths("/out/low.safetensors", ["transformer_2"]) == \
        {"transformer_2": Path("/out/low.safetensors")}
    # a name that says nothing, or both experts: the pair
    assert [p.name for p in expert_output_paths("/out/lora.safetensors", ["transformer"]).values()] == \
        ["lora_high_noise.safetensors"]
    assert [p.name for p in expert_output_paths("/out/high.safetensors", ["transformer", "transformer_2"]).values()] \
        == ["high_high_noise.safetensors", "high_low_noise.safetensors"]


def test_a_kept_earlier_output_is_no_step_for_the_checkpoint_list():
    from modules.modelSampler.lora_checkpoints import step_from_name
    # before: the seconds of the run's name read as step 53
    assert step_from_name("demo_lora.previous-2026-11-27_21-51-53.safetensors") is None
    assert step_from_name("lora-500.safetensors") == 500
