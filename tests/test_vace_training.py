"""A LoRA trained on a tiny VACE model (`lora.targets: vace`: the VACE blocks alone) with controls, masks and
references: diffusers' `WanVACEPipeline.load_lora_weights` reads the file and changes its output exactly as the
adapter changed ours; the COMFY_LORA file names the VACE blocks as ComfyUI does; the header records the variant."""
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from learning import train
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.apply import lora_weights_from_peft
from modules.util.lora.format_notes import format_notes
from modules.util.lora.formats import save_lora_file
from modules.util.video_frames import write_video

FRAMES, SIZE = 9, 32


def _blocky(seed: int, frames: int = FRAMES) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, SIZE // 8, SIZE // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)


def vace_dataset(folder, count: int = 4):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        write_video(folder / f"clip_{i}.mp4", _blocky(i), 16)
        (folder / f"clip_{i}.txt").write_text("a red square moving right\n")
        (folder / f"clip_{i}_control").mkdir()
        for index, frame in enumerate(_blocky(100 + i)):
            Image.fromarray(frame).save(folder / f"clip_{i}_control" / f"{index:03d}.png")
        mask = np.zeros((SIZE, SIZE, 3), np.uint8)
        mask[:, SIZE // 2:] = 255
        Image.fromarray(mask).save(folder / f"clip_{i}_mask.png")
        Image.fromarray(_blocky(200 + i, 1)[0]).save(folder / f"clip_{i}_ref.png")
    return folder


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vace-train")
    folder = tiny_model("wan2.1-vace")
    trainer = train(tmp, folder, vace_dataset(tmp / "data"), steps=3,
                    overrides=["optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=8", "lora.targets=vace",
                               "output.format=DIFFUSERS_LORA"])
    for part in trainer.model.parts().values():
        part.eval()
    return trainer, tmp, folder


def _sample(data) -> SampleConfig:
    return SampleConfig(prompt="a red square moving right", negative_prompt="blurry", width=SIZE, height=SIZE,
                        frames=FRAMES, steps=2, guidance=3.0, seed=5, control_video=str(data / "clip_0_control"),
                        mask_video=str(data / "clip_0_mask.png"), reference_images=[str(data / "clip_0_ref.png")])


@torch.no_grad()
def _pipeline_latents(pipe, data) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    control = [Image.open(p) for p in sorted((data / "clip_0_control").iterdir())]
    mask = [Image.open(data / "clip_0_mask.png")] * FRAMES
    return pipe(prompt="a red square moving right", negative_prompt="blurry", video=control, mask=mask,
                reference_images=[Image.open(data / "clip_0_ref.png")], height=SIZE, width=SIZE, num_frames=FRAMES,
                num_inference_steps=2, guidance_scale=3.0, generator=torch.Generator().manual_seed(5),
                output_type="latent").frames[:, :, 1:]


def test_only_the_vace_blocks_train_and_diffusers_reproduces_the_trained_output(trained):
    from diffusers import WanVACEPipeline
    trainer, tmp, folder = trained
    weights = lora_weights_from_peft(trainer.model.transformer)
    assert weights and all(name.startswith("vace_blocks.") for name in weights)
    assert {name.split(".")[1] for name in weights} == {"0", "1"}
    assert all(module.up.abs().sum() > 0 for module in weights.values())   # every lora_B trained
    ours = WanModelSampler(trainer.model, device="cpu").sample(_sample(tmp / "data")).latents
    peer = WanVACEPipeline.from_pretrained(folder)
    base = _pipeline_latents(peer, tmp / "data")[0]
    peer.load_lora_weights(str(tmp / "out.safetensors"), adapter_name="trained")
    theirs = _pipeline_latents(peer, tmp / "data")[0]
    assert (theirs - base).abs().max() > 1e-3   # the adapter changes the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    with safe_open(str(tmp / "out.safetensors"), "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "wan_2_1_vace/lora"


def test_comfy_lora_names_the_vace_blocks_as_comfyui(trained, tmp_path):
    """diffusers' converter of original-name Wan LoRAs needs base blocks (`min()` of none): the run says to write
    DIFFUSERS_LORA for diffusers; this fails, and the note goes, once diffusers reads such files."""
    from diffusers import WanVACEPipeline
    trainer, _, folder = trained
    path = tmp_path / "comfy.safetensors"
    save_lora_file(lora_weights_from_peft(trainer.model.transformer), ModelFormat.COMFY_LORA, path)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert "diffusion_model.vace_blocks.0.before_proj.lora_A.weight" in keys
    assert "diffusion_model.vace_blocks.1.self_attn.q.lora_B.weight" in keys
    assert "diffusion_model.vace_blocks.1.ffn.0.alpha" in keys
    assert all(key.startswith("diffusion_model.vace_blocks.") for key in keys)
    with pytest.raises(ValueError):
        WanVACEPipeline.from_pretrained(folder).load_lora_weights(str(path))
    [note] = format_notes("LORA", "COMFY_LORA", targets="vace")
    assert "<name>.diffusers.safetensors (DIFFUSERS_LORA) for WanVACEPipeline" in note
    assert not any("VACE" in n for n in format_notes("LORA", "DIFFUSERS_LORA", targets="vace"))


def test_a_full_fine_tune_of_the_vace_blocks_alone_leaves_the_base_untouched(tiny_model, tmp_path):
    """`fine_tune.layer_filter: ["vace_"]`: the VACE blocks and their patch embedding train, the base stays as loaded."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    folder = tiny_model("wan2.1-vace")
    before = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder))).transformer.state_dict()
    trainer = train(tmp_path, folder, vace_dataset(tmp_path / "data", count=2), "FINE_TUNE", 2,
                    ["optimizer.learning_rate=0.01", 'fine_tune.layer_filter=["vace_"]'])
    after = trainer.model.transformer.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name].to(before[name].dtype))}
    assert changed and all(name.startswith(("vace_blocks.", "vace_patch_embedding.")) for name in changed)
    assert any(name.startswith("vace_patch_embedding.") for name in changed)


def test_a_preview_takes_its_samples_control_mask_and_references(trained, tmp_path):
    """A samples file's control_video / mask_video / reference_images (relative to the file) reach the preview: it
    equals `sample` given the same inputs, and differs from the preview without the control."""
    import json
    import shutil

    from modules.modelSampler.TrainingSampler import TrainingSampler, frame_strip
    trainer, tmp, _ = trained
    data = tmp / "data"
    samples = tmp_path / "samples"
    shutil.copytree(data / "clip_0_control", samples / "control")
    for name in ("clip_0_mask.png", "clip_0_ref.png"):
        shutil.copy(data / name, samples / name)
    common = dict(prompt="a red square moving right", width=SIZE, height=SIZE, frames=FRAMES, steps=2, seed=5,
                  guidance=3.0, negative_prompt="blurry")
    (samples / "samples.json").write_text(json.dumps([
        {**common, "control_video": "control", "mask_video": "clip_0_mask.png", "reference_images": ["clip_0_ref.png"]},
        {**common, "mask_video": "clip_0_mask.png", "reference_images": ["clip_0_ref.png"]}]))
    trainer.config.sampling.samples_file = str(samples / "samples.json")
    outputs = TrainingSampler(trainer).sample_all()
    assert len(outputs) == 2
    strips = [np.array(Image.open(output.strip)) for output in outputs]
    direct = WanModelSampler(trainer.model, "cpu").sample(_sample(data)).frames_uint8()
    np.testing.assert_array_equal(strips[0], frame_strip(direct))
    assert not np.array_equal(strips[0], strips[1])


def test_a_comfy_lora_save_writes_the_file_wan_vace_pipeline_reads_and_both_give_the_trained_output(trained, tmp_path):
    """COMFY_LORA keeps ComfyUI's names; the companion `<name>.diffusers.safetensors` beside it loads in
    `WanVACEPipeline.load_lora_weights`, whose output equals our sampler's with the COMFY_LORA file merged."""
    from diffusers import WanVACEPipeline

    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSampler.sampling_io import apply_lora_files
    from modules.util.config.ModelConfig import ModelConfig
    trainer, tmp, folder = trained
    comfy, companion = trainer.setup.save_result(str(tmp_path / "vace.safetensors"), ModelFormat.COMFY_LORA, None,
                                                 None)
    assert companion == tmp_path / "vace.diffusers.safetensors"
    with safe_open(str(comfy), "pt") as f:
        assert all(key.startswith("diffusion_model.vace_blocks.") for key in f.keys())
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))
    apply_lora_files(model, [(comfy, 1.0)])
    ours = WanModelSampler(model, device="cpu").sample(_sample(tmp / "data")).latents
    peer = WanVACEPipeline.from_pretrained(folder)
    base = _pipeline_latents(peer, tmp / "data")[0]
    peer.load_lora_weights(str(companion), adapter_name="trained")
    theirs = _pipeline_latents(peer, tmp / "data")[0]
    assert (theirs - base).abs().max() > 1e-3   # the adapter changes the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
