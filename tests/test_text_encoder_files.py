"""The UMT5 text encoder from the files users hold (official Wan T5 .pth, ComfyUI umt5_xxl safetensors, fp8_scaled)
computes what the diffusers folder's text_encoder computes."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, UMT5EncoderModel

from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo, read_keys_and_shapes, shard_set
from modules.modelLoader.wan.parts.text_encoder_files import (load_text_encoder, recognise_text_encoder,
                                                              text_encoder_config)
from modules.util.fp8_scaled import ScaledFp8Linear
from modules.util.tiny_model_files import to_scaled_fp8_text_encoder, umt5_to_comfyui, umt5_to_wan_t5

PROMPT = "a red ball moving left in a wide scene"


@pytest.fixture(scope="module")
def reference(tiny_model):
    folder = tiny_model("wan2.1-t2v")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    ids = tokenizer(PROMPT, return_tensors="pt")
    model = UMT5EncoderModel.from_pretrained(folder / "text_encoder", torch_dtype=torch.float32)
    state = load_file(str(folder / "text_encoder" / "model.safetensors"))
    return model, ids, state


def _embed(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.input_ids, attention_mask=ids.attention_mask).last_hidden_state


def _write(tmp_path, layout, state):
    if layout == "wan":
        path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
        torch.save(umt5_to_wan_t5(state), path)   # a plain dict of tensors, as the official file
        return path
    if layout == "transformers_sharded":   # a diffusers text_encoder/ as sharded files (UMT5-XXL ships in 5)
        names = sorted(state)
        half = len(names) // 2
        weight_map = {}
        for index, group in enumerate((names[:half], names[half:]), start=1):
            shard = f"model-{index:05d}-of-00002.safetensors"
            save_file({k: state[k] for k in group}, str(tmp_path / shard))
            weight_map.update(dict.fromkeys(group, shard))
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return tmp_path / "model-00002-of-00002.safetensors"   # any shard names the set
    if layout == "comfyui":
        converted = umt5_to_comfyui(state)
    elif layout == "comfyui_no_encoder_prefix":
        converted = umt5_to_comfyui(state, stack_prefix="")
    else:   # a checkpoint bundling the encoder under an outer prefix, beside other tensors
        converted = {f"text_encoders.umt5xxl.transformer.{k}": v for k, v in umt5_to_comfyui(state).items()}
        converted["model.diffusion_model.unrelated.weight"] = torch.zeros(2)
    path = tmp_path / "umt5_xxl.safetensors"
    save_file(converted, str(path))
    return path


@pytest.mark.parametrize("layout", ["wan", "comfyui", "comfyui_no_encoder_prefix", "comfyui_bundled",
                                    "transformers_sharded"])
def test_text_encoder_layouts_compute_the_diffusers_embeddings(reference, tmp_path, layout):
    model, ids, state = reference
    path = _write(tmp_path, layout, state)
    files = shard_set(path)
    recognised = recognise_text_encoder(read_keys_and_shapes(files))
    assert recognised == ("wan" if layout == "wan" else "comfyui")
    loaded = load_text_encoder(files, recognised, torch.float32)
    assert loaded.config.d_model == model.config.d_model and loaded.config.num_heads == model.config.num_heads
    assert loaded.get_input_embeddings() is loaded.encoder.embed_tokens
    torch.testing.assert_close(_embed(loaded, ids), _embed(model, ids), atol=1e-6, rtol=0)


def test_scaled_fp8_text_encoder_is_within_fp8_tolerance_of_its_dequantised_weights(reference, tmp_path):
    model, ids, state = reference
    quantised = to_scaled_fp8_text_encoder(umt5_to_comfyui(state))
    path = tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
    save_file(quantised, str(path))
    keys = read_keys_and_shapes(path)
    assert keys["scaled_fp8"].dtype == "float8_e4m3fn"
    assert recognise_text_encoder(keys) == "comfyui"
    loaded = load_text_encoder([path], "comfyui", torch.float32)
    # the reference: the file's own fp8 numbers times their scales, in the diffusers model
    dequantised = {}
    for key, value in quantised.items():
        if key == "scaled_fp8" or key.endswith(".scale_weight"):
            continue
        scale = quantised.get(key.removesuffix(".weight") + ".scale_weight")
        dequantised[key] = value.float() * scale if scale is not None else value.float()
    reference_model = UMT5EncoderModel(model.config).eval()
    reference_model.load_state_dict(dequantised, strict=False)
    reference_model.tie_weights()
    assert torch.equal(loaded.encoder.block[0].layer[0].SelfAttention.q.weight,
                       dequantised["encoder.block.0.layer.0.SelfAttention.q.weight"])
    torch.testing.assert_close(_embed(loaded, ids), _embed(reference_model, ids), atol=1e-6, rtol=0)
    # and fp8 stays close to the full-precision encoder (the quantisation error, not a wrong mapping)
    error = (_embed(loaded, ids) - _embed(model, ids)).abs().max() / _embed(model, ids).abs().max()
    assert 0 < error < 0.1
    # kept in float8 (text encoder weight dtype FLOAT_8): the same numbers, dequantised per call
    kept = load_text_encoder([path], "comfyui", torch.float32, keep_fp8=True)
    attention = kept.encoder.block[0].layer[0].SelfAttention
    assert isinstance(attention.q, ScaledFp8Linear) and attention.q.weight.dtype == torch.float8_e4m3fn
    assert kept.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32   # UMT5 casts wo's input
    torch.testing.assert_close(_embed(kept, ids), _embed(reference_model, ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_dtypes_are_those_from_pretrained_gives(reference, tiny_model, tmp_path, dtype):
    """float16 keeps the feed-forward output `wo` in float32 (T5 overflows float16 there), as from_pretrained does."""
    _, ids, state = reference
    path = _write(tmp_path, "wan", state)
    loaded = load_text_encoder([path], "wan", dtype)
    folder_model = UMT5EncoderModel.from_pretrained(tiny_model("wan2.1-t2v") / "text_encoder", torch_dtype=dtype)
    assert {n: p.dtype for n, p in loaded.named_parameters()} == \
        {n: p.dtype for n, p in folder_model.named_parameters()}
    torch.testing.assert_close(_embed(loaded, ids), _embed(folder_model, ids), atol=0, rtol=0)


def test_released_umt5_xxl_config_comes_back_from_its_shapes():
    shapes = {"shared.weight": (256384, 4096)}
    for i in range(24):
        shapes[f"encoder.block.{i}.layer.0.SelfAttention.q.weight"] = (4096, 4096)
        shapes[f"encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"] = (32, 64)
        shapes[f"encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight"] = (10240, 4096)
    config = text_encoder_config(shapes, "umt5")
    assert (config["d_model"], config["d_kv"], config["num_heads"], config["d_ff"], config["num_layers"],
            config["vocab_size"], config["relative_attention_num_buckets"]) == (4096, 64, 64, 10240, 24, 256384, 32)
    assert config["feed_forward_proj"] == "gated-gelu" and config["relative_attention_max_distance"] == 128


def test_plain_t5_and_wrong_shapes_are_refused(reference, tmp_path):
    _, _, state = reference
    t5_like = {k: v for k, v in umt5_to_comfyui(state).items() if "block.1.layer.0.SelfAttention.relative" not in k}
    assert recognise_text_encoder({k: TensorInfo(tuple(v.shape), "float32") for k, v in t5_like.items()}) is None
    broken = umt5_to_comfyui(state)
    broken["encoder.block.1.layer.1.DenseReluDense.wo.weight"] = torch.zeros(3, 3)
    path = tmp_path / "broken.safetensors"
    save_file(broken, str(path))
    with pytest.raises(ModelFileError, match=r"broken\.safetensors.*wrong shape.*wo\.weight"):
        load_text_encoder([path], "comfyui", torch.float32)


@pytest.mark.parametrize("layout", ["wan", "comfyui"])
def test_the_real_umt5_xxl_file_names_and_shapes_plan_the_released_encoder(layout):
    """A real-size encoder (meta tensors: names and shapes only) in each layout is recognised and checked whole."""
    from accelerate import init_empty_weights
    from transformers import UMT5Config

    from modules.modelLoader.wan.parts.text_encoder_files import CONFIG_PATH, plan_text_encoder

    released = json.loads(CONFIG_PATH.read_text())
    with init_empty_weights():
        state = UMT5EncoderModel(UMT5Config(**released)).state_dict()
    converted = umt5_to_wan_t5(state) if layout == "wan" else umt5_to_comfyui(state)
    keys = {k: TensorInfo(tuple(v.shape), "bfloat16") for k, v in converted.items()}
    assert keys["token_embedding.weight" if layout == "wan" else "shared.weight"].shape == (256384, 4096)
    assert recognise_text_encoder(keys) == layout
    _, config = plan_text_encoder(keys, layout, "umt5-xxl")
    # (transformers 5 forces tie_word_embeddings for the T5 family; an encoder has no head to tie)
    compared = [k for k in released if k not in ("architectures", "tie_word_embeddings")]
    assert {k: getattr(config, k) for k in compared} == {k: released[k] for k in compared}


def test_an_encoder_loaded_from_the_official_pth_saves_as_a_diffusers_text_encoder(reference, tmp_path):
    """convert_model's path: what was read from Wan's file saves with save_pretrained and loads back the same."""
    model, ids, state = reference
    loaded = load_text_encoder([_write(tmp_path, "wan", state)], "wan", torch.float32)
    loaded.save_pretrained(tmp_path / "text_encoder")
    again = UMT5EncoderModel.from_pretrained(tmp_path / "text_encoder", torch_dtype=torch.float32)
    assert torch.equal(_embed(again, ids), _embed(model, ids))
