"""Whole models from the files users hold: per-part overrides in other layouts on a diffusers base, training a LoRA
on a ComfyUI fp8_scaled transformer, and the wrong-file errors that come before any weight loads."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from learning import train
from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
from modules.util.fp8_scaled import ScaledFp8Linear
from modules.modelLoader.wan.parts.model_plan import plan_model
from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.trainer.prepare import prepare_config
from modules.util.config.ModelConfig import ModelConfig, PartConfig
from modules.util.config.config_io import ConfigError, load_config
from tests.wan_file_layouts import (COMFY_PREFIX, official_transformer_config, to_fp8_scaled, transformer_to_original,
                                    vae21_to_original, vae22_to_original, write_release_transformer)


def _state(folder, part):
    return load_file(str(folder / part / "diffusion_pytorch_model.safetensors"))


def _comfy_transformer(folder, path, fp8_scaled=False):
    original = transformer_to_original(_state(folder, "transformer"), prefix=COMFY_PREFIX)
    save_file(to_fp8_scaled(original) if fp8_scaled else original, str(path))
    return path


def _official_vae(folder, path):
    state = _state(folder, "vae")
    torch.save(vae22_to_original(state) if state["post_quant_conv.weight"].shape[0] == 48 else vae21_to_original(state),
               path)
    return path


def test_lora_trains_on_a_comfyui_fp8_scaled_transformer_with_the_official_vae(tiny_model, squares_dataset,
                                                                                tmp_path):
    """Today's traceback: KeyError "Wan original key 'scaled_fp8' has no counterpart in the key table"."""
    base = tiny_model("wan2.1-t2v")
    transformer = _comfy_transformer(base, tmp_path / "wan2.1_t2v_tiny_fp8_scaled.safetensors", fp8_scaled=True)
    vae = _official_vae(base, tmp_path / "Wan2.1_VAE.pth")
    trainer = train(tmp_path, base, squares_dataset, steps=2,
                    overrides=[f"model.transformer.path={transformer}", f"model.vae.path={vae}",
                               "optimizer.learning_rate=0.01"])
    model = trainer.model
    assert any("wan2.1_t2v_tiny_fp8_scaled.safetensors: comfyui, fp8_scaled [model.transformer.path]; kept in "
               "float8, computed in float32" in line for line in model.part_messages), model.part_messages
    assert any("wan2.1" in line and "Wan2.1_VAE.pth" in line for line in model.part_messages)
    q = model.transformer.get_submodule("blocks.0.attn1.to_q")
    base_layer = q.base_layer if hasattr(q, "base_layer") else q
    assert isinstance(base_layer, ScaledFp8Linear) and base_layer.weight.dtype == torch.float8_e4m3fn
    stored = load_file(str(transformer))
    assert torch.equal(base_layer.weight.view(torch.uint8),
                       stored[COMFY_PREFIX + "blocks.0.self_attn.q.weight"].view(torch.uint8))   # frozen
    lora_b = [p for n, p in model.transformer.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)
    assert (tmp_path / "out.safetensors").is_file()


def test_full_fine_tune_of_fp8_weights_is_refused_before_loading(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    transformer = _comfy_transformer(base, tmp_path / "t_fp8_scaled.safetensors", fp8_scaled=True)
    config = load_config(overrides=[f"model.base_model_name={base}", f"model.transformer.path={transformer}",
                                    "training_method=FINE_TUNE", "output.format=ORIGINAL", "device=cpu",
                                    f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                                    f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as error:
        prepare_config(config)
    assert any("t_fp8_scaled.safetensors holds fp8_scaled weights; a full fine-tune needs full-precision" in p
               for p in error.value.problems)
    dora = load_config(overrides=[f"model.base_model_name={base}", f"model.transformer.path={transformer}",
                                  "training_method=LORA", "lora.dora=true", "device=cpu",
                                  f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                                  f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as error:
        prepare_config(dora)
    assert any(p.startswith("lora.dora: ") and "fp8_scaled" in p for p in error.value.problems), error.value.problems


def _plan(base, **parts):
    return plan_model(ModelConfig(base_model_name=str(base), **{k: PartConfig(path=str(v)) for k, v in parts.items()}))


def test_a_vae_file_given_as_the_transformer_is_refused(tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")
    vae = tmp_path / "wan_2.1_vae.safetensors"   # ComfyUI's VAE file
    save_file(vae21_to_original(_state(base, "vae")), str(vae))
    with pytest.raises(ModelFileError, match=r"model.transformer.path: .*wan_2.1_vae.safetensors holds vae "
                                             r"\(wan2.1\), not a Wan transformer"):
        _plan(base, transformer=vae)
    # a transformer is read from safetensors only (the restricted .pth reader is for the VAE, T5 and CLIP files)
    with pytest.raises(ModelFileError, match=r"model.transformer.path: .*Wan2.1_VAE.pth' is a .pth file; only "
                                             r"safetensors files are read"):
        _plan(base, transformer=_official_vae(base, tmp_path / "Wan2.1_VAE.pth"))


def test_a_wan21_vae_with_a_ti2v_transformer_is_refused(tiny_model, tmp_path):
    base = tiny_model("wan2.2-ti2v-5b")
    vae = _official_vae(tiny_model("wan2.1-t2v"), tmp_path / "Wan2.1_VAE.pth")
    with pytest.raises(ModelFileError, match=r"Wan2.1_VAE.pth is the Wan 2.1 VAE \(16 latent channels\).*48 "
                                             r"channels \(Wan 2.2 TI2V-5B needs the Wan 2.2 VAE\)"):
        _plan(base, vae=vae)


def test_an_i2v_transformer_without_an_image_encoder_is_refused(tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")   # holds no image encoder
    i2v = tiny_model("wan2.1-i2v")
    transformer = _comfy_transformer(i2v, tmp_path / "wan2.1_i2v_tiny.safetensors")
    (tmp_path / "config.json").write_text((i2v / "transformer" / "config.json").read_text())
    with pytest.raises(ModelFileError, match=r"wan2.1_i2v_tiny.safetensors is a Wan I2V transformer with an image "
                                             r"\(CLIP\) branch and no image encoder was found: set "
                                             r"model.image_encoder.path"):
        _plan(base, transformer=transformer)


def _shards(base, folder):
    original = transformer_to_original(_state(base, "transformer"))
    names = sorted(original)
    folder.mkdir()
    for index, half in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        shard = folder / f"diffusion_pytorch_model-0000{index}-of-00002.safetensors"
        save_file({k: original[k] for k in half}, str(shard))
    return folder


def test_missing_and_truncated_shards_are_named_before_weights_load(tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")
    shards = _shards(base, tmp_path / "shards")
    second = shards / "diffusion_pytorch_model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="diffusion_pytorch_model-00002-of-00002.safetensors: truncated"):
        WanBaseModelLoader().load(ModelConfig(base_model_name=str(base), transformer=PartConfig(path=str(shards))))
    second.unlink()
    with pytest.raises(ModelFileError, match="diffusion_pytorch_model-00002-of-00002.safetensors: shard missing"):
        _plan(base, transformer=shards / "diffusion_pytorch_model-00001-of-00002.safetensors")


def test_sharded_official_transformer_and_wan22_vae_load_into_a_model(tiny_model, tmp_path):
    base = tiny_model("wan2.2-ti2v-5b")
    shards = _shards(base, tmp_path / "shards")
    vae = _official_vae(base, tmp_path / "Wan2.2_VAE.pth")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base), transformer=PartConfig(path=str(shards)),
                                                  vae=PartConfig(path=str(vae))))
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    assert model.variant == reference.variant and model.expand_timesteps
    for part in ("transformer", "vae"):
        ours, theirs = getattr(model, part).state_dict(), getattr(reference, part).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_full_fine_tune_of_a_comfyui_file_saves_an_original_file_that_loads_in_its_place(tiny_model, squares_dataset,
                                                                                          tmp_path):
    base = tiny_model("wan2.1-t2v")
    transformer = _comfy_transformer(base, tmp_path / "wan2.1_t2v_tiny_fp32.safetensors")
    trainer = train(tmp_path, base, squares_dataset, method="FINE_TUNE", steps=1,
                    overrides=[f"model.transformer.path={transformer}", "optimizer.learning_rate=0.01"])
    trained = {k: v.detach().clone() for k, v in trainer.model.transformer.state_dict().items()}
    saved = tmp_path / "out.safetensors"
    reloaded = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base),
                                                     transformer=PartConfig(path=str(saved))))
    assert any("out.safetensors" in line and ": wan, fp32" in line for line in reloaded.part_messages)
    state = reloaded.transformer.state_dict()
    assert state.keys() == trained.keys() and all(torch.equal(state[k], trained[k]) for k in trained)
    assert not all(torch.equal(trained[k], v) for k, v in _state(base, "transformer").items())   # it trained


def test_fp8_scaled_output_is_read_back_as_fp8_scaled_within_fp8_precision(tiny_model, tmp_path):
    from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
    from modules.util.enum.ModelFormat import ModelFormat
    base = tiny_model("wan2.1-t2v")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    [path] = WanBaseModelSaver().save(model, ModelFormat.ORIGINAL_FP8_SCALED, tmp_path / "t2v_fp8_scaled.safetensors")
    reloaded = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base), transformer=PartConfig(path=str(path))))
    assert any(": wan, fp8_scaled" in line for line in reloaded.part_messages)
    layer = reloaded.transformer.get_submodule("blocks.1.ffn.net.2")
    assert isinstance(layer, ScaledFp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    original = model.transformer.get_submodule("blocks.1.ffn.net.2").weight.detach()
    error = (layer.dequantised_weight(torch.float32) - original).abs()
    # float8_e4m3fn: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 spaced 2^-9 apart
    assert (error <= original.abs() * 2 ** -4 + layer.scale_weight * 2 ** -9).all()


def test_an_official_a14b_folder_is_planned_by_its_expert_folders(tiny_model, tmp_path):
    base = tiny_model("wan2.2-t2v-a14b")
    release = tmp_path / "Wan2.2-T2V-A14B"
    release.mkdir()
    for expert, folder in (("transformer", "high_noise_model"), ("transformer_2", "low_noise_model")):
        original = transformer_to_original(_state(base, expert))
        (release / folder).mkdir()
        save_file(original, str(release / folder / "diffusion_pytorch_model.safetensors"))
        # the Wan repository's own config.json format (wan/modules/model.py WanModel arguments)
        diffusers_config = json.loads((base / expert / "config.json").read_text())
        (release / folder / "config.json").write_text(json.dumps(official_transformer_config(diffusers_config)))
    _official_vae(base, release / "Wan2.1_VAE.pth")
    plan = plan_model(ModelConfig(base_model_name=str(release),
                                  text_encoder=PartConfig(path=str(base / "text_encoder"))))
    assert plan.variant.value == "T2V_A14B" and plan.diffusers_base is None
    assert plan.parts["transformer"].files[0].parent.name == "high_noise_model"
    assert plan.parts["transformer_2"].files[0].parent.name == "low_noise_model"
    # the official sample_shift of T2V-A14B, not diffusers' hub default 3
    assert plan.model_index["boundary_ratio"] == 0.875 and plan.scheduler_config["flow_shift"] == 12.0
    # the same two experts as loose files cannot be told apart by their tensors: the error says how to name them
    loose = tmp_path / "comfy"
    loose.mkdir()
    for expert in ("transformer", "transformer_2"):
        _comfy_transformer(base, loose / f"{expert}.safetensors")
    with pytest.raises(ModelFileError, match="2 transformers found .* model.transformer.path \\(high noise\\) and "
                                             "model.transformer_2.path \\(low noise\\)"):
        plan_model(ModelConfig(base_model_name=str(loose)))
    # named one by one, the two files are the pair (the tiny width needs its config beside them)
    (loose / "config.json").write_text((base / "transformer" / "config.json").read_text())
    plan = plan_model(ModelConfig(base_model_name=str(release),
                                  text_encoder=PartConfig(path=str(base / "text_encoder")),
                                  transformer=PartConfig(path=str(loose / "transformer.safetensors")),
                                  transformer_2=PartConfig(path=str(loose / "transformer_2.safetensors"))))
    assert plan.variant.value == "T2V_A14B"
    assert [plan.parts[e].files[0].name for e in ("transformer", "transformer_2")] == ["transformer.safetensors",
                                                                                      "transformer_2.safetensors"]


def test_convert_model_turns_a_comfyui_fp8_scaled_file_into_a_diffusers_folder(tiny_model, tmp_path):
    import sys
    from pathlib import Path
    from diffusers import WanTransformer3DModel
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import convert_model
    from modules.util.lora.keys import original_to_diffusers_state_dict
    from tests.wan_file_layouts import dequantised
    base = tiny_model("wan2.1-t2v")
    source = _comfy_transformer(base, tmp_path / "wan_fp8_scaled.safetensors", fp8_scaled=True)
    out = tmp_path / "converted"
    assert convert_model.main(["--input-name", str(source), "--base-model-name", str(base),
                               "--output-model-format", "DIFFUSERS", "--output-model-destination", str(out)]) == 0
    converted = WanTransformer3DModel.from_pretrained(out, subfolder="transformer").state_dict()
    expected = original_to_diffusers_state_dict(dequantised(load_file(str(source))))
    assert converted.keys() == expected.keys()   # no scale_weight / scaled_fp8 left in the diffusers folder
    for name, value in expected.items():   # float32 throughout: the fp8 numbers times their scale, exactly
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], value), name


def test_sample_script_takes_part_files_and_they_load_the_diffusers_folders_weights(tiny_model, tmp_path):
    from modules.modelSampler.sampling_io import load_model_for_sampling
    from modules.util.enum.DataType import DataType
    from tests.wan_file_layouts import sample_tiny_video
    base = tiny_model("wan2.1-t2v")
    transformer = _comfy_transformer(base, tmp_path / "wan2.1_t2v_tiny_fp32.safetensors")
    vae = _official_vae(base, tmp_path / "Wan2.1_VAE.pth")
    parts = {"transformer": str(transformer), "vae": str(vae)}
    ours = load_model_for_sampling(str(base), DataType.FLOAT_32, torch.device("cpu"), part_paths=parts)
    theirs = load_model_for_sampling(str(base), DataType.FLOAT_32, torch.device("cpu"))
    for part in ("transformer", "vae", "text_encoder"):
        a, b = getattr(ours, part).state_dict(), getattr(theirs, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert ours.noise_scheduler.config == theirs.noise_scheduler.config

    assert sample_tiny_video(base, tmp_path / "samples", ["--transformer", str(transformer), "--vae", str(vae)]) == 5


def test_searching_a_folder_skips_other_tools_pickles_but_not_a_damaged_safetensors_file(tiny_model, tmp_path,
                                                                                          caplog):
    base = tiny_model("wan2.1-t2v")
    folder = tmp_path / "models"
    folder.mkdir()
    _comfy_transformer(base, folder / "t2v.safetensors")
    (folder / "config.json").write_text((base / "transformer" / "config.json").read_text())
    _official_vae(base, folder / "Wan2.1_VAE.pth")
    torch.save({"state_dict": {"w": torch.ones(1)}, "global_step": 10}, folder / "other_tool.ckpt")
    text_encoder = PartConfig(path=str(base / "text_encoder"))
    plan = plan_model(ModelConfig(base_model_name=str(folder), text_encoder=text_encoder))
    assert plan.parts["transformer"].files == [folder / "t2v.safetensors"]
    assert "other_tool.ckpt: entry 'global_step' is a int" in caplog.text
    data = (folder / "t2v.safetensors").read_bytes()
    (folder / "t2v.safetensors").write_bytes(data[:-10])
    with pytest.raises(ModelFileError, match="t2v.safetensors: truncated"):
        plan_model(ModelConfig(base_model_name=str(folder), text_encoder=text_encoder))


def test_a_comfyui_folder_with_a_config_json_is_searched_file_by_file(tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")
    folder = tmp_path / "comfy"
    folder.mkdir()
    _comfy_transformer(base, folder / "wan2.1_t2v_tiny.safetensors")
    (folder / "config.json").write_text((base / "transformer" / "config.json").read_text())
    save_file(vae21_to_original(_state(base, "vae")), str(folder / "wan_2.1_vae.safetensors"))
    text_encoder = PartConfig(path=str(base / "text_encoder"))
    plan = plan_model(ModelConfig(base_model_name=str(folder), text_encoder=text_encoder))
    assert (plan.parts["transformer"].layout, plan.parts["vae"].layout) == ("comfyui", "wan2.1")
    assert plan.parts["vae"].files == [folder / "wan_2.1_vae.safetensors"]


def test_a_misshapen_text_encoder_file_is_refused_by_the_plan(tiny_model, tmp_path):
    from modules.util.tiny_model_files import write_comfy_encoders
    base = tiny_model("wan2.1-t2v")
    [text] = write_comfy_encoders(base, tmp_path / "enc").values()
    state = load_file(str(text))
    key = next(k for k in state if k.endswith("block.1.layer.1.DenseReluDense.wo.weight"))
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(text))
    with pytest.raises(ModelFileError, match="umt5_xxl_fp16.safetensors: the tensors do not make a UMT5 encoder"):
        _plan(base, text_encoder=text)


def test_part_files_on_a_hub_id_base_use_the_same_readers(tiny_model, tmp_path):
    """With a hub-id base (no local folder to search) each part file is read by itself: here the VAE .pth and the
    ComfyUI UMT5 file, as WanBaseModelLoader's diffusers path reads them."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel
    from modules.util.tiny_model_files import write_comfy_encoders
    base = tiny_model("wan2.1-t2v")
    vae = _official_vae(base, tmp_path / "Wan2.1_VAE.pth")
    text = write_comfy_encoders(base, tmp_path / "enc")["text_encoder"]
    loader = WanBaseModelLoader()
    ours = loader._load_part(PartConfig(path=str(vae)), "Wan-AI/any", "vae", AutoencoderKLWan, {})
    theirs = AutoencoderKLWan.from_pretrained(base, subfolder="vae")
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in theirs.state_dict().items())
    encoder = loader._load_part(PartConfig(path=str(text)), "Wan-AI/any", "text_encoder", UMT5EncoderModel, {})
    reference = UMT5EncoderModel.from_pretrained(base, subfolder="text_encoder")
    tokens = torch.tensor([[5, 7, 9, 1]])
    with torch.no_grad():
        torch.testing.assert_close(encoder(tokens).last_hidden_state, reference(tokens).last_hidden_state,
                                   atol=1e-6, rtol=0)


def test_a_base_folder_with_too_many_folders_below_fails_fast(tmp_path):
    for index in range(70):
        (tmp_path / "home" / f"dir{index}").mkdir(parents=True)
    with pytest.raises(ModelFileError, match="home: more than 64 folders below it; name the model's own folder"):
        plan_model(ModelConfig(base_model_name=str(tmp_path / "home")))


def test_the_official_shard_index_names_the_sharded_transformer(tiny_model, squares_dataset, tmp_path):
    """`model.transformer.path` = the release's diffusion_pytorch_model.safetensors.index.json (the name of its
    sharded set). Before: refused by the config check and the plan as "not a safetensors file"."""
    from modules.util.config.validation import path_problems
    base = tiny_model("wan2.1-t2v")
    index_file = write_release_transformer(base, tmp_path)
    config = load_config(overrides=[f"model.base_model_name={base}", f"model.transformer.path={index_file}",
                                    "device=cpu", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                                    f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    assert not [p for p in path_problems(config) if "model.transformer.path" in p]
    plan = plan_model(config.model)
    assert plan.parts["transformer"].files == [tmp_path / f"diffusion_pytorch_model-0000{i}-of-00002.safetensors"
                                               for i in (1, 2)]
    # an index naming anything but safetensors shards is refused
    index_file.write_text(json.dumps({"weight_map": {"blocks.0.self_attn.q.weight": "evil.pth"}}))
    with pytest.raises(ModelFileError, match=r"index\.json: a safetensors index naming other files \(evil\.pth\)"):
        plan_model(config.model)
