"""Wan2.1-Fun InP 1.3B (aigc-apps/VideoX-Fun `pipeline_wan_fun_inpaint.py`): the I2V layout (16 noise + 4 mask +
16 masked-video channels, CLIP image tokens) at the released 1.3B width, which alone tells it from Wan 2.1 I2V. The
tiny model keeps that width; a LoRA trains on it with the clip's first frame as the start image, and our sampler
gives exactly what diffusers' `WanImageToVideoPipeline` gives with the trained transformer."""
import numpy as np
import pytest
import torch
from PIL import Image

from learning import train
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.lora.apply import lora_weights_from_peft
from modules.util.video_frames import write_video
from modules.util.wan_detection import WIDTH_1_3B, detect_variant_from_folder, read_json
from test_sampler import reference_frames

FRAMES, SIZE = 5, 32


def _blocky(seed: int, frames: int = FRAMES) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, SIZE // 8, SIZE // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fun-inp")
    data = tmp / "data"
    data.mkdir()
    for i in range(2):
        write_video(data / f"clip_{i}.mp4", _blocky(i), 16)
        (data / f"clip_{i}.txt").write_text("a red square moving right\n")
    trainer = train(tmp, tiny_model("wan2.1-fun-inp"), data, steps=2,
                    overrides=["optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=8", "batch_size=2",
                               "data.frame_buckets=[5]"])
    for part in trainer.model.parts().values():
        part.eval()
    return trainer, tmp


def test_the_tiny_model_is_told_as_fun_inp_by_its_width(tiny_model):
    folder = tiny_model("wan2.1-fun-inp")
    config = read_json(folder / "transformer" / "config.json")
    assert config["in_channels"] == 36
    assert config["num_attention_heads"] * config["attention_head_dim"] == WIDTH_1_3B
    assert detect_variant_from_folder(folder) is WanVariant.FUN_INP


def test_a_lora_trains_on_the_first_frame_condition_and_samples_as_diffusers(trained, tmp_path):
    trainer, tmp = trained
    batch = next(iter(trainer.data.batches(0)))
    assert batch["condition"].shape[1:] == (20, 2, SIZE // 8, SIZE // 8)   # mask 4 + masked-video latents 16
    assert "image_embeds" in batch                                         # the start frame's CLIP tokens
    weights = lora_weights_from_peft(trainer.model.transformer)
    assert weights and all(module.up.abs().sum() > 0 for module in weights.values())   # every lora_B trained
    Image.fromarray(_blocky(7, 1)[0]).save(tmp_path / "start.png")
    sample = SampleConfig(prompt="a red square moving right", negative_prompt="blurry", width=SIZE, height=SIZE,
                          frames=FRAMES, steps=2, guidance=3.0, seed=4, image=str(tmp_path / "start.png"))
    ours = WanModelSampler(trainer.model, "cpu").sample(sample)
    theirs = reference_frames(trainer.model.create_pipeline(image_mode=True), sample)
    assert ours.frames.shape == theirs.shape == (FRAMES, SIZE, SIZE, 3)
    np.testing.assert_allclose(ours.frames, theirs, atol=1e-5, rtol=0)
    Image.fromarray(_blocky(8, 1)[0]).save(tmp_path / "other.png")
    other = WanModelSampler(trainer.model, "cpu").sample(
        sample.model_copy(update={"image": str(tmp_path / "other.png")}))
    assert np.abs(other.frames - ours.frames).max() > 0.01   # the start image conditions the video
