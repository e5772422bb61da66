"""Wan-Fun Control and InP (aigc-apps/VideoX-Fun, commit 804a425): the variants told by content, the condition
built as VideoX-Fun's pipelines build it (checked against a line-by-line transcription of their tensor preparation),
a LoRA trained with `<name>_control` companions that feeds exactly that condition, and sampling with a control video
(with a mask for the A14B model; with a start image for InP, equal to diffusers' I2V pipeline)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from learning import train
from modules.model.fun_condition import fun_control_a14b_condition, fun_control_condition
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, read_keys_and_shapes
from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import write_video
from modules.util.wan_detection import detect_variant_from_folder, fun_variant
from tests.wan_file_layouts import transformer_to_original

FRAMES, SIZE = 9, 32


def _encode_fn(seed: int = 0):
    """A deterministic stand-in for the VAE's normalised posterior mean: (1, 3, F, H, W) -> (1, 16, T, h, w); a
    fixed random linear map of each 8x8 cell (the frames folded 4 to 1 as the Wan VAE's stride)."""
    weight = torch.randn(16, 3 * 64, generator=torch.Generator().manual_seed(seed))

    def encode(video):
        frames = video.shape[2]
        padded = torch.cat([video[:, :, :1].repeat(1, 1, 3, 1, 1), video], dim=2)   # 4T frames
        b, c, f, height, width = padded.shape
        # (B, C, 4T, H, W) -> (B, T, h, w, 4, C * 64): each 8x8 cell of four frames, its frames averaged
        cells = padded.view(b, c, f // 4, 4, height // 8, 8, width // 8, 8).permute(0, 2, 4, 6, 3, 1, 5, 7)
        cells = cells.reshape(b, f // 4, height // 8, width // 8, 4, c * 64).mean(4)
        return torch.einsum("oc,bthwc->bothw", weight, cells)[:, :, :(frames - 1) // 4 + 1]
    return encode


# --- VideoX-Fun's tensor preparation, transcribed (videox_fun/pipeline/*.py at 804a425; the VAE call replaced by
# `encode`, which is VideoX-Fun's `vae.encode(x)[0].mode()`: its AutoencoderKLWan normalises in encode) ---------

def videox_fun_2_1_control(encode, control_video, start_image, latents):
    # pipeline_wan_fun_control.py 613-628: control_video_latents = prepare_control_latents(None, control_video)[1]
    control_video_latents = encode(control_video) if control_video is not None else torch.zeros_like(latents)  # 631
    if start_image is not None:
        start_image_latentes = encode(start_image)                                        # 640-650
        start_image_latentes_conv_in = torch.zeros_like(latents)                          # 652
        if latents.size()[2] != 1:                                                        # 653
            start_image_latentes_conv_in[:, :, :1] = start_image_latentes                 # 654
    else:
        start_image_latentes_conv_in = torch.zeros_like(latents)                          # 656
    control_latents_input = control_video_latents                                         # 724-726
    return torch.cat([control_latents_input, start_image_latentes_conv_in], dim=1)        # 732-733


def resize_mask(mask, latent, process_first_frame_only=True):                            # pipeline_wan2_2_fun_control.py 100
    latent_size = latent.size()
    target_size = list(latent_size[2:])
    target_size[0] = 1
    first_frame_resized = F.interpolate(mask[:, :, 0:1, :, :], size=target_size, mode='trilinear',
                                        align_corners=False)
    target_size = list(latent_size[2:])
    target_size[0] = target_size[0] - 1
    if target_size[0] != 0:
        remaining_frames_resized = F.interpolate(mask[:, :, 1:, :, :], size=target_size, mode='trilinear',
                                                 align_corners=False)
        return torch.cat([first_frame_resized, remaining_frames_resized], dim=2)
    return first_frame_resized


def videox_fun_2_2_control(encode, control_video, init_video, mask_video, latents):
    control_video_latents = encode(control_video)                                         # 2_2 fun_control: control
    bs, _, video_length, height, width = init_video.size()
    if (mask_video == 255).all():                                                         # 644
        mask_latents = torch.tile(torch.zeros_like(latents)[:, :1], [1, 4, 1, 1, 1])
        masked_video_latents = torch.zeros_like(latents)
    else:
        mask_condition = (mask_video / 255 >= 0.5).float()        # mask_processor: do_binarize (0.5), grayscale
        masked_video = init_video * (torch.tile(mask_condition, [1, 3, 1, 1, 1]) < 0.5)    # 657
        masked_video_latents = encode(masked_video)                                       # 658
        mask_condition = torch.concat([torch.repeat_interleave(mask_condition[:, :, 0:1], repeats=4, dim=2),
                                       mask_condition[:, :, 1:]], dim=2)                  # 671-676
        mask_condition = mask_condition.view(bs, mask_condition.shape[2] // 4, 4, height, width)  # 677
        mask_condition = mask_condition.transpose(1, 2)                                   # 678
        mask_latents = resize_mask(1 - mask_condition, masked_video_latents, True)        # 679
    y = torch.cat([mask_latents, masked_video_latents], dim=1)                            # 814
    return torch.cat([control_video_latents, y], dim=1)                                   # 815-816


def test_the_wan_2_1_condition_equals_videox_funs():
    encode = _encode_fn()
    control = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1
    start = torch.rand(1, 3, 1, SIZE, SIZE) * 2 - 1
    latents = torch.zeros(1, 16, 3, SIZE // 8, SIZE // 8)
    for given_control, given_start in ((control, start), (None, start), (control, None)):
        ours = fun_control_condition(encode, None if given_control is None else given_control[0],
                                     None if given_start is None else given_start[0, :, 0], FRAMES, SIZE, SIZE)
        theirs = videox_fun_2_1_control(encode, given_control, given_start, latents)[0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours.shape == (32, 3, SIZE // 8, SIZE // 8)


def test_the_wan_2_2_a14b_condition_equals_videox_funs():
    encode = _encode_fn(1)
    control = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1
    video = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1
    latents = torch.zeros(1, 16, 3, SIZE // 8, SIZE // 8)
    mask = torch.zeros(1, 1, FRAMES, SIZE, SIZE)
    mask[:, :, 1:, :, 5:] = 255        # frame 0 kept, a region not on the 8x8 grid generated after it
    for pixel_mask in (mask, torch.full_like(mask, 255)):
        ours = fun_control_a14b_condition(encode, control[0], video[0], pixel_mask[0] / 255, FRAMES, SIZE, SIZE)
        theirs = videox_fun_2_2_control(encode, control, video, pixel_mask, latents)[0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours.shape == (36, 3, SIZE // 8, SIZE // 8)


# --- variants -------------------------------------------------------------------------------------------------

def test_the_variants_are_told_by_their_input_channels(tiny_model):
    assert detect_variant_from_folder(tiny_model("wan2.1-fun-control")) is WanVariant.FUN_CONTROL
    assert fun_variant(52, 16, True, 5120) is WanVariant.FUN_CONTROL_A14B
    assert fun_variant(36, 16, False, 1536) is WanVariant.FUN_INP       # no 1.3B I2V exists
    assert fun_variant(36, 16, False, 5120) is None                     # 14B InP: the I2V layout, read as I2V
    assert fun_variant(36, 16, True, 5120) is None                      # Wan2.2-Fun InP A14B: the I2V-A14B layout
    assert WanVariant.FUN_CONTROL.has_image_encoder and not WanVariant.FUN_CONTROL.takes_image_condition
    assert WanVariant.FUN_CONTROL_A14B.has_two_experts and WanVariant.FUN_CONTROL_A14B.fun_condition_channels == 36


def test_a_v1_1_reference_convolution_is_refused_naming_its_tensors(tiny_model, tmp_path):
    from diffusers import WanTransformer3DModel
    folder = tiny_model("wan2.1-fun-control")
    transformer = WanTransformer3DModel.from_pretrained(folder / "transformer")
    state = transformer_to_original(transformer.state_dict())
    keys = read_keys_and_shapes([_save(state, tmp_path / "fun.safetensors")])
    config = transformer_config_from_shapes(_diffusers_keys(keys), "fun.safetensors", dict(transformer.config))
    assert config["in_channels"] == 48
    state.update({"ref_conv.weight": torch.zeros(64, 16, 2, 2), "ref_conv.bias": torch.zeros(64)})   # VideoX-Fun 741
    with pytest.raises(ModelFileError, match=r"add_ref_conv.*ref_conv\.bias, ref_conv\.weight"):
        keys = read_keys_and_shapes([_save(state, tmp_path / "v11.safetensors")])
        transformer_config_from_shapes(_diffusers_keys(keys), "v11.safetensors", dict(transformer.config))


def _save(state, path):
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _diffusers_keys(keys):
    """The file's tensors under diffusers names, as the loader reads an official-layout file."""
    from modules.modelLoader.wan.parts.transformer_files import recognise_transformer
    return recognise_transformer(keys).shapes


# --- training and sampling ------------------------------------------------------------------------------------

def _blocky(seed: int, frames: int = FRAMES) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, SIZE // 8, SIZE // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)


def train_lora(folder, tmp, clips: int, controls: bool = True, overrides=()):
    """A 2-step LoRA on `clips` random blocky clips (each with a control video when `controls`); (trainer, data)."""
    data = tmp / "data"
    data.mkdir()
    for i in range(clips):
        write_video(data / f"clip_{i}.mp4", _blocky(i), 16)
        (data / f"clip_{i}.txt").write_text("a red square moving right\n")
        if controls:
            write_video(data / f"clip_{i}_control.mp4", _blocky(100 + i), 16)
    trainer = train(tmp, folder, data, steps=2, overrides=["optimizer.learning_rate=0.01", "lora.rank=4",
                                                           "lora.alpha=8", *overrides])
    for part in trainer.model.parts().values():
        part.eval()
    return trainer, data


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    return train_lora(tiny_model("wan2.1-fun-control"), tmp_path_factory.mktemp("fun-train"), 4)


def test_training_feeds_videox_funs_condition_of_the_clips_control(trained):
    trainer, data = trained
    model = trainer.model
    from modules.model.vace_condition import model_encoder
    from modules.util.video_frames import frames_to_tensor
    from modules.util.video_io import read_media
    batch = next(iter(trainer.data.batches(0)))
    index = [i for i, p in enumerate(batch["path"]) if p.endswith("clip_0.mp4")][0] if "path" in batch else None
    assert batch["condition"].shape[1:] == (32, 3, SIZE // 8, SIZE // 8)
    clip = frames_to_tensor(read_media(str(data / "clip_0.mp4")))
    control = frames_to_tensor(read_media(str(data / "clip_0_control.mp4")))
    with torch.no_grad():
        expected = fun_control_condition(model_encoder(model), control, clip[:, 0], FRAMES, SIZE, SIZE)
    conditions = batch["condition"] if index is None else batch["condition"][index:index + 1]
    assert any(torch.allclose(c, expected, atol=1e-5) for c in conditions)
    assert "image_embeds" in batch   # the start frame's CLIP tokens, VideoX-Fun's clip_fea


def test_sampling_feeds_the_control_and_start_image_as_videox_fun(trained, tmp_path):
    trainer, data = trained
    model = trainer.model
    seen = []
    hook = model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"][:, 16:].clone()), with_kwargs=True)
    Image.fromarray(_blocky(7, 1)[0]).save(tmp_path / "start.png")
    sample = SampleConfig(prompt="a red square moving right", width=SIZE, height=SIZE, frames=FRAMES, steps=2,
                          guidance=1.0, seed=3, control_video=str(data / "clip_1_control.mp4"),
                          image=str(tmp_path / "start.png"))
    try:
        with_control = WanModelSampler(model, "cpu").sample(sample).latents
        without = WanModelSampler(model, "cpu").sample(sample.model_copy(update={"control_video": ""})).latents
    finally:
        hook.remove()
    from modules.model.vace_condition import model_encoder
    from modules.modelSampler.fun_sampling import fun_condition
    with torch.no_grad():
        start = WanModelSampler._load_image(str(tmp_path / "start.png"), SIZE, SIZE)
        expected = fun_condition(model, sample, start)
    torch.testing.assert_close(seen[0][0], expected, rtol=0, atol=1e-5)
    assert not torch.allclose(with_control, without)


def test_a_vace_sample_field_on_a_fun_control_model_is_named(trained):
    trainer, data = trained
    sample = SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=FRAMES, steps=1,
                          control_video=str(data / "clip_1_control.mp4"), reference_images=[str(data / "clip_1.txt")])
    with pytest.raises(Exception, match="Wan-Fun Control.*takes control_video, not reference_images"):
        WanModelSampler(trainer.model, "cpu").resolve(sample)


def _refused_before_loading(base, lora, tmp_path, capsys, monkeypatch) -> str:
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from tests.script_loader import load_script
    loads = []
    monkeypatch.setattr(WanBaseModelLoader, "load", lambda *args, **kwargs: loads.append(args))
    code = load_script("sample").main(["--base-model-name", str(base), "--lora", str(lora), "--prompt", "x",
                                       "--width", "32", "--height", "32", "--frames", "5", "--steps", "1",
                                       "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert code == 1 and loads == []   # refused from the headers, before any weight loads
    return capsys.readouterr().err


def test_a_fun_control_lora_on_a_vace_model_and_the_reverse_are_refused_before_loading(
        trained, tiny_model, tmp_path, capsys, monkeypatch):
    from modules.util.modelspec import modelspec_metadata
    trainer, _ = trained
    fun_lora = trainer.config.output.destination   # the trained LoRA: its header records Wan 2.1 Fun Control
    message = _refused_before_loading(tiny_model("wan2.1-vace"), fun_lora, tmp_path, capsys, monkeypatch)
    assert "made for wan_2_1_fun_control (Wan 2.1 Fun Control), a Wan-Fun Control" in message
    assert "the model is VACE" in message and "different routes" in message
    vace_lora = tmp_path / "vace_lora.safetensors"
    save_file({"diffusion_model.vace_blocks.0.proj_out.lora_A.weight": torch.zeros(4, 64)}, str(vace_lora),
              metadata=modelspec_metadata(WanVariant.VACE, lora=True))
    message = _refused_before_loading(tiny_model("wan2.1-fun-control"), vace_lora, tmp_path, capsys, monkeypatch)
    assert "made for wan_2_1_vace (Wan 2.1 VACE), a VACE" in message and "the model is FUN_CONTROL" in message


@pytest.mark.parametrize("variant", ["wan2.1-fun-control", "wan2.2-fun-control-a14b"])
def test_sample_py_takes_a_control_video_for_a_fun_control_model(variant, tiny_model, tmp_path):
    """And a mask video where the variant takes one (the A14B model)."""
    from tests.wan_file_layouts import sample_tiny_video
    write_video(tmp_path / "control.mp4", _blocky(9, 5), 16)
    Image.fromarray(_blocky(8, 1)[0]).save(tmp_path / "start.png")
    extra = ["--control-video", str(tmp_path / "control.mp4"), "--image", str(tmp_path / "start.png")]
    if "a14b" in variant:
        mask = np.zeros((SIZE, SIZE, 3), np.uint8)
        mask[:, SIZE // 2:] = 255
        Image.fromarray(mask).save(tmp_path / "mask.png")
        extra += ["--mask-video", str(tmp_path / "mask.png")]
    assert sample_tiny_video(tiny_model(variant), tmp_path / "out", extra) == 5


# --- Wan2.2-Fun Control A14B: two experts, control + mask + masked video ---------------------------------------

@pytest.fixture(scope="module")
def trained_a14b(tiny_model, tmp_path_factory):
    return train_lora(tiny_model("wan2.2-fun-control-a14b"), tmp_path_factory.mktemp("fun-a14b-train"), 2,
                      overrides=["batch_size=2", "expert=high"])


def test_a14b_trains_on_videox_funs_condition_with_the_first_frame_kept(trained_a14b):
    from modules.model.fun_condition import first_frame_inputs
    from modules.model.vace_condition import model_encoder
    from modules.util.lora.apply import lora_weights_from_peft
    from modules.util.video_frames import frames_to_tensor
    from modules.util.video_io import read_media
    trainer, data = trained_a14b
    model = trainer.model
    assert model.variant is WanVariant.FUN_CONTROL_A14B and model.transformer.config.in_channels == 52
    batch = next(iter(trainer.data.batches(0)))
    assert batch["condition"].shape[1:] == (36, 3, SIZE // 8, SIZE // 8)
    assert "image_embeds" not in batch   # Wan 2.2: no CLIP
    clip = frames_to_tensor(read_media(str(data / "clip_0.mp4")))
    control = frames_to_tensor(read_media(str(data / "clip_0_control.mp4")))
    with torch.no_grad():
        expected = fun_control_a14b_condition(model_encoder(model), control, *first_frame_inputs(clip), FRAMES, SIZE,
                                              SIZE)
    assert any(torch.allclose(c, expected, atol=1e-5) for c in batch["condition"])
    weights = lora_weights_from_peft(model.transformer)   # the high-noise expert's adapter
    assert weights and all(module.up.abs().sum() > 0 for module in weights.values())   # every lora_B trained


def test_a14b_samples_through_both_experts_with_the_control_and_mask(trained_a14b, tmp_path):
    from modules.modelSampler.fun_sampling import fun_condition
    trainer, data = trained_a14b
    model = trainer.model
    seen = {"transformer": [], "transformer_2": []}
    hooks = [getattr(model, name).register_forward_pre_hook(
        lambda module, args, kwargs, name=name: seen[name].append(kwargs["hidden_states"][:, 16:].clone()),
        with_kwargs=True) for name in seen]
    mask = np.zeros((SIZE, SIZE, 3), np.uint8)
    mask[:, SIZE // 2:] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    Image.fromarray(_blocky(7, 1)[0]).save(tmp_path / "start.png")
    # 2 steps: UniPC's timesteps 999 and 500 fall on each side of the boundary 0.9, one step for each expert
    sample = SampleConfig(prompt="a red square moving right", width=SIZE, height=SIZE, frames=FRAMES, steps=2,
                          guidance=1.0, seed=3, control_video=str(data / "clip_1_control.mp4"),
                          mask_video=str(tmp_path / "mask.png"), image=str(tmp_path / "start.png"))
    try:
        with_control = WanModelSampler(model, "cpu").sample(sample).latents
        other = WanModelSampler(model, "cpu").sample(
            sample.model_copy(update={"control_video": str(data / "clip_0_control.mp4")})).latents
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        expected = fun_condition(model, sample, WanModelSampler._load_image(str(tmp_path / "start.png"), SIZE, SIZE))
    assert expected.shape[0] == 36
    assert len(seen["transformer"]) == len(seen["transformer_2"]) == 2
    torch.testing.assert_close(seen["transformer"][0][0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(seen["transformer_2"][0][0], expected, rtol=0, atol=1e-5)
    assert not torch.allclose(with_control, other)   # the control steers the result


# --- Wan2.1-Fun InP 1.3B: the I2V layout at the released 1.3B width -------------------------------------------
# 16 noise + 4 mask + 16 masked-video channels and CLIP image tokens (VideoX-Fun `pipeline_wan_fun_inpaint.py`); the
# width alone tells it from Wan 2.1 I2V, so its tiny model keeps 12 heads of 128

@pytest.fixture(scope="module")
def trained_inp(tiny_model, tmp_path_factory):
    return train_lora(tiny_model("wan2.1-fun-inp"), tmp_path_factory.mktemp("fun-inp"), 2, controls=False,
                      overrides=["batch_size=2"])


def test_the_tiny_inp_model_is_told_as_fun_inp_by_its_width(tiny_model):
    from modules.util.wan_detection import WIDTH_1_3B, read_json
    folder = tiny_model("wan2.1-fun-inp")
    config = read_json(folder / "transformer" / "config.json")
    assert config["in_channels"] == 36
    assert config["num_attention_heads"] * config["attention_head_dim"] == WIDTH_1_3B
    assert detect_variant_from_folder(folder) is WanVariant.FUN_INP


def test_an_inp_lora_trains_on_the_first_frame_condition_and_samples_as_diffusers(trained_inp, tmp_path):
    from modules.util.lora.apply import lora_weights_from_peft
    from test_sampler import reference_frames
    trainer, _ = trained_inp
    batch = next(iter(trainer.data.batches(0)))
    assert batch["condition"].shape[1:] == (20, 3, SIZE // 8, SIZE // 8)   # mask 4 + masked-video latents 16
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
