"""A training run and a sample from the folders users hold: ComfyUI single files, an official Wan release, and a
mix (official VAE .pth + ComfyUI transformer + diffusers text encoder). Tiny models, written with the real key
names (tests/wan_file_layouts.py)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from learning import train
from modules.util.config.ModelConfig import ModelConfig
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.tiny_model_files import write_comfy_encoders, write_official_encoders
from tests.wan_file_layouts import (COMFY_PREFIX, official_transformer_config, sample_tiny_video,
                                    transformer_to_original, vae21_to_original, write_release_transformer)


def _state(folder, part, name="diffusion_pytorch_model.safetensors"):
    return load_file(str(folder / part / name))


def comfyui_folder(base, folder):
    """models/diffusion_models + vae + text_encoders, flattened: ComfyUI's file names and key names."""
    folder.mkdir()
    save_file(transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX),
              str(folder / "wan2.1_t2v_tiny_fp32.safetensors"))
    # the tiny transformer is 64 wide: no released width, so its head count comes from a config.json beside it
    shutil.copy(base / "transformer" / "config.json", folder / "config.json")
    save_file(vae21_to_original(_state(base, "vae")), str(folder / "wan_2.1_vae.safetensors"))
    write_comfy_encoders(base, folder)
    return folder


def official_folder(base, folder):
    """Wan2.1-T2V as the Wan-AI repository ships it: original-key shards + index + the Wan config.json, the VAE and
    T5 .pth files, the google/umt5-xxl tokenizer folder."""
    folder.mkdir()
    write_release_transformer(base, folder)
    torch.save(vae21_to_original(_state(base, "vae")), folder / "Wan2.1_VAE.pth")
    write_official_encoders(base, folder)
    return folder


def _same_weights(model, reference):
    for part in ("transformer", "vae", "text_encoder"):
        ours, theirs = getattr(model, part).state_dict(), getattr(reference, part).state_dict()
        assert ours.keys() == theirs.keys(), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def _check_run(tmp_path, squares_dataset, base_model, reference_folder, overrides, sample_arguments):
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(reference_folder)))
    trainer = train(tmp_path, base_model, squares_dataset, steps=2,
                    overrides=["optimizer.learning_rate=0.01", *overrides])
    assert (tmp_path / "out.safetensors").is_file()
    lines = trainer.model.part_messages
    assert [line.split(":")[0] for line in lines[1:]] == ["transformer", "vae", "text_encoder", "tokenizer"], lines
    # the parts read from these files are the diffusers folder's, exactly
    _same_weights(WanBaseModelLoader().load(trainer.config.model), reference)
    assert sample_tiny_video(base_model, tmp_path / "samples", sample_arguments) == 5
    from modules.trainer.run_report import start_report
    return lines, start_report(trainer, [])


def test_a_folder_of_comfyui_files_trains_and_samples(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    comfy = comfyui_folder(base, tmp_path / "ComfyUI_models")
    tokenizer = base / "tokenizer"   # the tiny tokenizer is no sentencepiece model a ComfyUI file could embed
    lines, _ = _check_run(tmp_path, squares_dataset, comfy, base, [f"model.tokenizer.path={tokenizer}"],
                       ["--tokenizer", str(tokenizer)])
    assert "wan2.1_t2v_tiny_fp32.safetensors: comfyui, fp32" in lines[1]
    assert "wan_2.1_vae.safetensors: wan2.1, fp32" in lines[2]


def test_an_official_release_folder_trains_and_samples(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    release = official_folder(base, tmp_path / "Wan2.1-T2V-tiny")
    lines, plan = _check_run(tmp_path, squares_dataset, release, base, [], [])
    # no scheduler config of its own: the run plan names the official settings it samples with
    assert "the official T2V settings where a sample sets none: flow shift 5, 50 steps, guidance 5 " \
           "(Wan-Video/Wan2.1 generate.py" in plan
    assert "diffusion_pytorch_model-00001-of-00002.safetensors (+1 shards): wan, fp32" in lines[1]
    assert "Wan2.1_VAE.pth: wan2.1, fp32" in lines[2]
    assert "models_t5_umt5-xxl-enc-bf16.pth" in lines[3]


def test_a_mix_of_official_vae_comfyui_transformer_and_diffusers_text_encoder_trains_and_samples(
        tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    folder = tmp_path / "mine"
    folder.mkdir()
    save_file(transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX),
              str(folder / "wan2.1_t2v_tiny.safetensors"))
    shutil.copy(base / "transformer" / "config.json", folder / "config.json")
    vae = tmp_path / "Wan2.1_VAE.pth"
    torch.save(vae21_to_original(_state(base, "vae")), vae)
    parts = {"vae": vae, "text_encoder": base / "text_encoder", "tokenizer": base / "tokenizer"}
    lines, _ = _check_run(tmp_path, squares_dataset, folder, base,
                       [f"model.{name}.path={path}" for name, path in parts.items()],
                       [argument for name, path in parts.items() for argument in (f"--{name.replace('_', '-')}",
                                                                                  str(path))])
    assert "Wan2.1_VAE.pth: wan2.1, fp32 [model.vae.path]" in lines[2]
    assert "text_encoder: " in lines[3] and ": diffusers, fp32 [model.text_encoder.path]" in lines[3]


def test_official_i2v_and_a14b_release_folders_load_the_diffusers_folders_parts(tiny_model, tmp_path):
    """I2V: the CLIP .pth (open-clip XLM-RoBERTa ViT-H/14 as Wan ships it) gives the image tokens the diffusers
    folder's CLIP gives; A14B: the experts come from high_noise_model/ and low_noise_model/."""
    from PIL import Image
    i2v = tiny_model("wan2.1-i2v")
    release = official_folder(i2v, tmp_path / "Wan2.1-I2V-tiny")
    # the tiny CLIP is 24 wide, no released width: its config.json goes beside it (the release folder's own
    # config.json is the transformer's), so it moves to a folder of its own, which the search finds
    clip = release / "clip"
    clip.mkdir()
    (release / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth").rename(
        clip / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    shutil.copy(i2v / "image_encoder" / "config.json", clip / "config.json")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(release)))
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(i2v)))
    assert model.variant.value == "I2V"
    _same_weights(model, reference)
    image = Image.new("RGB", (40, 24), (200, 30, 90))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image([image]), reference.encode_image([image]), atol=1e-6, rtol=0)

    a14b = tiny_model("wan2.2-t2v-a14b")
    release = tmp_path / "Wan2.2-T2V-A14B-tiny"
    for expert, folder in (("transformer", "high_noise_model"), ("transformer_2", "low_noise_model")):
        (release / folder).mkdir(parents=True)
        save_file(transformer_to_original(_state(a14b, expert)), str(release / folder / "model.safetensors"))
        config = json.loads((a14b / expert / "config.json").read_text())
        (release / folder / "config.json").write_text(json.dumps(official_transformer_config(config)))
    torch.save(vae21_to_original(_state(a14b, "vae")), release / "Wan2.1_VAE.pth")
    write_official_encoders(a14b, release)
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(release)))
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(a14b)))
    assert model.variant.value == "T2V_A14B" and model.boundary_ratio == 0.875
    for expert in ("transformer", "transformer_2"):
        ours, theirs = getattr(model, expert).state_dict(), getattr(reference, expert).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), expert


def test_a_missing_tokenizer_is_a_config_problem_before_anything_loads(tiny_model, squares_dataset, tmp_path):
    from modules.trainer.prepare import prepare_config
    from modules.util.config.config_io import ConfigError, load_config
    comfy = comfyui_folder(tiny_model("wan2.1-t2v"), tmp_path / "ComfyUI_models")
    config = load_config(overrides=[f"model.base_model_name={comfy}", "device=cpu",
                                    f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                                    f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as error:
        prepare_config(config)
    assert any(problem.startswith("no UMT5 tokenizer found") and "set model.tokenizer.path" in problem
               for problem in error.value.problems), error.value.problems


def test_a_comfyui_models_tree_of_an_i2v_model_loads(tiny_model, tmp_path):
    """ComfyUI's own folders (models/diffusion_models, vae, text_encoders, clip_vision) as the base model."""
    from PIL import Image
    i2v = tiny_model("wan2.1-i2v")
    models = tmp_path / "ComfyUI" / "models"
    for sub in ("diffusion_models", "vae", "text_encoders", "clip_vision"):
        (models / sub).mkdir(parents=True)
    save_file(transformer_to_original(_state(i2v, "transformer"), prefix=COMFY_PREFIX),
              str(models / "diffusion_models" / "wan2.1_i2v_tiny_fp32.safetensors"))
    shutil.copy(i2v / "transformer" / "config.json", models / "diffusion_models" / "config.json")
    save_file(vae21_to_original(_state(i2v, "vae")), str(models / "vae" / "wan_2.1_vae.safetensors"))
    written = write_comfy_encoders(i2v, models / "text_encoders")
    written["image_encoder"].rename(models / "clip_vision" / written["image_encoder"].name)
    shutil.copy(i2v / "image_encoder" / "config.json", models / "clip_vision" / "config.json")   # tiny: 24 wide
    config = ModelConfig(base_model_name=str(models), tokenizer={"path": str(i2v / "tokenizer")})
    model = WanBaseModelLoader().load(config)
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(i2v)))
    assert model.variant.value == "I2V"
    assert [line.split(":")[0] for line in model.part_messages[1:]] == ["transformer", "vae", "text_encoder",
                                                                          "image_encoder", "tokenizer"]
    _same_weights(model, reference)
    image = Image.new("RGB", (40, 24), (20, 130, 90))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image([image]), reference.encode_image([image]), atol=1e-6, rtol=0)
