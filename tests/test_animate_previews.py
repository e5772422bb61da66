"""Previews while training an Animate LoRA come from the samples file's Animate fields (reference image, pose and face
videos, paths relative to the file) and are what the sampler makes from the same inputs; DoRA and LoKr adapters train
on Animate, save, and applied to a fresh model from their files give the trained model's output."""
import json

import pytest
import torch

from modules.util.demo_animate import make_animate_dataset
from modules.util.video_frames import write_video
from modules.util.video_io import read_media
from tests.learning import train


@pytest.mark.parametrize("adapter", [["lora.dora=true"], ["lora.type=LOKR", "lora.decompose_factor=4"]],
                         ids=["dora", "lokr"])
def test_previews_use_the_animate_fields_and_the_adapter_file_matches(tiny_model, tmp_path, adapter):
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
    from modules.util.config.SampleConfig import SampleConfig
    from modules.util.enum.DataType import DataType
    data = make_animate_dataset(tmp_path / "data", clips_per_class=1, frames=5, size=32)
    stem = "red_left_00"
    fields = dict(reference_image=f"data/{stem}_ref.png", pose_video=f"data/{stem}_pose.mp4",
                  face_video=f"data/{stem}_face.mp4")
    (tmp_path / "samples.json").write_text(json.dumps([dict(prompt="a person", width=32, height=32, frames=5,
                                                            steps=3, guidance=1.0, seed=7, **fields)]))
    trainer = train(tmp_path, tiny_model("wan2.2-animate"), data, steps=1, overrides=[
        "data.frame_buckets=[5]", "optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=4", *adapter,
        f"sampling.samples_file={tmp_path / 'samples.json'}", "sampling.every_n_steps=1"])
    previews = sorted(trainer.samples_dir.glob("0-a-person/*.mp4"))
    assert previews, "no preview was written"
    sample = SampleConfig(prompt="a person", width=32, height=32, frames=5, steps=3, guidance=1.0, seed=7,
                          **{k: str(tmp_path / v) for k, v in fields.items()})
    trained = WanModelSampler(trainer.model, device=torch.device("cpu")).sample(sample)
    write_video(tmp_path / "ours.mp4", trained.frames_uint8(), trained.fps)
    assert (read_media(previews[-1]) == read_media(tmp_path / "ours.mp4")).all()
    # the saved adapter, applied to a fresh model, makes what the trained model makes
    model = load_model_for_sampling(str(tiny_model("wan2.2-animate")), DataType.FLOAT_32, torch.device("cpu"),
                                    loras=[(tmp_path / "out.safetensors", 1.0)])
    base = WanModelSampler(model, device=torch.device("cpu")).sample(sample)
    apply_lora_files(model, [(tmp_path / "out.safetensors", 1.0)])
    applied = WanModelSampler(model, device=torch.device("cpu")).sample(sample)
    assert (base.latents - trained.latents).abs().max() > 1e-4   # the adapter changed the output
    torch.testing.assert_close(applied.latents, trained.latents, rtol=0, atol=1e-4)
