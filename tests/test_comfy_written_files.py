"""Files as ComfyUI itself writes them today (not only as Comfy-Org released them): its mixed-precision fp8 format,
a text encoder saved with CLIPSave, a whole Wan checkpoint from Save Checkpoint. Each name is from ComfyUI's code
(cited in modules/util/tiny_model_files.py and tests/wan_file_layouts.py, which write them)."""
import json
import re

import pytest
import sentencepiece
import torch
from safetensors.torch import load_file, save_file
from transformers import UMT5EncoderModel

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelLoader.wan.parts.model_plan import plan_model
from modules.modelLoader.wan.parts.recognise import find_parts
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, read_keys_and_shapes
from modules.modelLoader.wan.parts.text_encoder_files import load_text_encoder
from modules.modelLoader.wan.parts.tokenizer_files import find_tokenizer
from modules.modelLoader.wan.parts.transformer_files import load_transformer
from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.DataType import DataType
from modules.util.tiny_model_files import (to_comfy_mixed_precision, to_scaled_fp8_text_encoder, train_sentencepiece,
                                           umt5_to_comfy_clipsave, umt5_to_comfyui)
from tests.wan_file_layouts import COMFY_PREFIX, comfy_checkpoint, to_fp8_scaled, transformer_to_original

PROMPT = "the video of a blue square moving up"


def _state(folder, part, name="diffusion_pytorch_model.safetensors"):
    return load_file(str(folder / part / name))


def _config(folder) -> dict:
    return json.loads((folder / "transformer" / "config.json").read_text())


def _load(path, base):
    [found] = [f for f in find_parts(path) if f.part == "transformer"]
    config = transformer_config_from_shapes(found.detail.shapes, str(path), _config(base))
    return found, load_transformer(found.files, found.detail, config, DataType.FLOAT_8, str(path))


def _forward(model, config):
    generator = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, config["in_channels"], 2, 4, 4, generator=generator),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, config["text_dim"], generator=generator))
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


@pytest.mark.parametrize("formats_in", ["comfy_quant_tensors", "safetensors_metadata"])
def test_comfyui_mixed_precision_fp8_transformer_loads_as_the_fp8_scaled_file_it_came_from(tiny_model, tmp_path,
                                                                                           formats_in):
    """ComfyUI (comfy/utils.py convert_old_quants, comfy/ops.py MixedPrecisionOps) writes `weight_scale` +
    `comfy_quant` (or the formats in `_quantization_metadata`) where the released files have `scale_weight` and the
    `scaled_fp8` marker: the same float8 numbers and scales. Before: 40 "unexpected" weight_scale / comfy_quant."""
    base = tiny_model("wan2.1-t2v")
    legacy = to_fp8_scaled(transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX))
    save_file(legacy, str(tmp_path / "legacy_fp8_scaled.safetensors"))
    current, metadata = to_comfy_mixed_precision(legacy, in_metadata=formats_in == "safetensors_metadata")
    assert any(k.endswith(".weight_scale") for k in current) and COMFY_PREFIX + "scaled_fp8" not in current
    assert any(k.endswith(".comfy_quant") for k in current) == (formats_in == "comfy_quant_tensors")
    save_file(current, str(tmp_path / "wan2.1_t2v_tiny_comfyui_saved.safetensors"), metadata=metadata)
    found, model = _load(tmp_path / "wan2.1_t2v_tiny_comfyui_saved.safetensors", base)
    _, reference = _load(tmp_path / "legacy_fp8_scaled.safetensors", base)
    assert (found.layout, found.dtype) == ("comfyui", "fp8_scaled")
    q = model.blocks[0].attn1.to_q
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_weight.dtype == torch.float32
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k].view(torch.uint8) if ours[k].dtype == torch.float8_e4m3fn else ours[k],
                           theirs[k].view(torch.uint8) if theirs[k].dtype == torch.float8_e4m3fn else theirs[k])
               for k in ours)
    torch.testing.assert_close(_forward(model, _config(base)), _forward(reference, _config(base)), atol=0, rtol=0)


def _block_scaled(state, layer, fmt):
    """One layer in a ComfyUI format this project does not read (comfy/quant_ops.py QUANT_ALGOS): nvfp4 (uint8
    packed weight, float8 block `weight_scale`, `weight_scale_2`), mxfp8 (float8 weight, uint8 e8m0 block scales per
    32 inputs), int8_tensorwise (int8 weight, float32 `weight_scale`)."""
    weight = state.pop(f"{layer}.weight")
    out_features, in_features = weight.shape
    if fmt == "nvfp4":
        state[f"{layer}.weight"] = torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
        state[f"{layer}.weight_scale"] = torch.zeros(out_features, in_features // 16).to(torch.float8_e4m3fn)
        state[f"{layer}.weight_scale_2"] = torch.ones(())
    elif fmt == "mxfp8":
        state[f"{layer}.weight"] = weight.to(torch.float8_e4m3fn)
        state[f"{layer}.weight_scale"] = torch.full((out_features, in_features // 32), 127, dtype=torch.uint8)
    else:
        state[f"{layer}.weight"] = torch.zeros(out_features, in_features, dtype=torch.int8)
        state[f"{layer}.weight_scale"] = torch.ones(())
    state[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    return state


@pytest.mark.parametrize("fmt,named", [("nvfp4", "weight stored as uint8 with a weight scale (ComfyUI's nvfp4"),
                                       ("mxfp8", "weight scale stored as uint8 (block scales: ComfyUI's mxfp8"),
                                       ("int8_tensorwise", "weight stored as int8 with a weight scale")])
def test_comfyui_block_scaled_and_integer_formats_are_refused_naming_a_layer_before_loading(tiny_model, tmp_path,
                                                                                           fmt, named):
    base = tiny_model("wan2.1-t2v")
    state = transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX)
    path = tmp_path / f"wan_{fmt}.safetensors"
    save_file(_block_scaled(state, COMFY_PREFIX + "blocks.1.ffn.0", fmt), str(path))
    expected = (rf"wan_{fmt}\.safetensors: quantized weights this project does not read \(1 layers, e\.g\. "
                rf"blocks\.1\.ffn\.net\.0\.proj: {re.escape(named)}")
    with pytest.raises(ModelFileError, match=expected):
        plan_model(ModelConfig(base_model_name=str(base), transformer={"path": str(path)}))


def test_a_tensor_the_key_table_does_not_know_is_named_not_dropped(tiny_model, tmp_path):
    """A ComfyUI file of a Wan derivative this project does not read (here a made-up `motion_adapter`) is no plain
    Wan transformer: before, such tensors were skipped without a word and the model loaded without them. (VACE's
    `vace_blocks` are read: tests/test_vace_files.py.)"""
    base = tiny_model("wan2.1-t2v")
    state = transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX)
    state[COMFY_PREFIX + "motion_adapter.0.proj.weight"] = torch.zeros(64, 64)
    path = tmp_path / "wan2.1_derivative_tiny.safetensors"
    save_file(state, str(path))
    with pytest.raises(Exception, match=r"1 unexpected \(e\.g\. \['motion_adapter\.0\.proj\.weight'\]\)"):
        WanBaseModelLoader().load(ModelConfig(base_model_name=str(base), transformer={"path": str(path)}))


@pytest.fixture(scope="module")
def spiece(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("spiece"))


def test_a_text_encoder_saved_by_comfyuis_clipsave_and_its_tokenizer_file(spiece, tmp_path):
    """CLIPSave keeps SDClipModel's `logit_scale` beside the T5 names and writes the tokenizer's `spiece_model` to a
    file of its own. Before: "1 unexpected (e.g. ['logit_scale'])", and no tokenizer found."""
    from modules.util.tiny_models import make_text_encoder
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spiece)).get_piece_size()
    reference = make_text_encoder(pieces, seed=0)
    weights, tokenizer_file = umt5_to_comfy_clipsave(reference.state_dict(), spiece.read_bytes())
    folder = tmp_path / "output" / "text_encoders"
    folder.mkdir(parents=True)
    encoder = folder / "ComfyUI_clip_umt5xxl_00001_.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(encoder))
    save_file(tokenizer_file, str(folder / "ComfyUI_clip_00001_.safetensors"))
    [found] = find_parts(encoder)
    assert (found.part, found.layout) == ("text_encoder", "comfyui")
    loaded = load_text_encoder([encoder], "comfyui", torch.float32)
    tokenizer = find_tokenizer(None, [encoder], False, "google/umt5-xxl")
    ids = tokenizer(PROMPT, return_tensors="pt")
    sentencepiece_ids = sentencepiece.SentencePieceProcessor(model_file=str(spiece)).encode(PROMPT)
    assert ids.input_ids[0].tolist() == sentencepiece_ids + [1]   # ComfyUI's SPieceTokenizer appends </s>
    with torch.no_grad():
        torch.testing.assert_close(loaded(**ids).last_hidden_state, reference(**ids).last_hidden_state,
                                   atol=1e-6, rtol=0)


def test_a_text_encoder_in_comfyuis_mixed_precision_format_loads_as_its_fp8_scaled_file(tiny_model, tmp_path):
    """What CLIPSave writes for an fp8_scaled UMT5 that ComfyUI loaded (convert_old_quants ran on it): before,
    28 "unexpected" weight_scale / comfy_quant tensors."""
    state = _state(tiny_model("wan2.1-t2v"), "text_encoder", "model.safetensors")
    legacy = to_scaled_fp8_text_encoder(umt5_to_comfyui(state))
    current, _ = to_comfy_mixed_precision(legacy)
    current["logit_scale"] = torch.tensor(4.6055)
    save_file(legacy, str(tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"))
    save_file(current, str(tmp_path / "ComfyUI_clip_umt5xxl_00001_.safetensors"))
    assert any(k.endswith(".comfy_quant") for k in read_keys_and_shapes(tmp_path / "ComfyUI_clip_umt5xxl_00001_"
                                                                                  ".safetensors"))
    [found] = find_parts(tmp_path / "ComfyUI_clip_umt5xxl_00001_.safetensors")
    assert (found.part, found.dtype) == ("text_encoder", "fp8_scaled")
    for keep_fp8 in (False, True):
        ours = load_text_encoder([tmp_path / "ComfyUI_clip_umt5xxl_00001_.safetensors"], "comfyui", torch.float32,
                                 keep_fp8=keep_fp8).state_dict()
        theirs = load_text_encoder([tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"], "comfyui", torch.float32,
                                   keep_fp8=keep_fp8).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k].float(), theirs[k].float()) for k in ours)


def test_a_comfyui_checkpoint_holding_transformer_vae_and_text_encoder_is_a_whole_base(tiny_model, tmp_path):
    """comfy/sd.py save_checkpoint for Wan: `model.diffusion_model.`, `vae.`, `text_encoders.umt5xxl.transformer.`
    in one file. Before: only the text encoder was found (the prefix was taken from the majority of keys)."""
    base = tiny_model("wan2.1-t2v")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    path = folder / "wan2.1_t2v_tiny_checkpoint.safetensors"
    save_file(comfy_checkpoint(_state(base, "transformer"), _state(base, "vae"),
                               _state(base, "text_encoder", "model.safetensors")), str(path))
    assert sorted((p.part, p.layout) for p in find_parts(path)) == [("text_encoder", "comfyui"),
                                                                    ("transformer", "comfyui"), ("vae", "wan2.1")]
    # the tiny transformer's head count is in no shape: its config.json beside the file, as for any 64-wide file
    (folder / "config.json").write_text((base / "transformer" / "config.json").read_text())
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder),
                                                  tokenizer={"path": str(base / "tokenizer")}))
    reference = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    assert [line.split(":")[0] for line in model.part_messages[1:4]] == ["transformer", "vae", "text_encoder"]
    assert all(str(path) in line for line in model.part_messages[1:4])
    for part in ("transformer", "vae", "text_encoder"):
        ours, theirs = getattr(model, part).state_dict(), getattr(reference, part).state_dict()
        assert ours.keys() == theirs.keys(), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part
    assert isinstance(model.text_encoder, UMT5EncoderModel)


def test_an_fp8_scaled_file_with_every_linear_scaled_computes_its_dequantised_weights(tiny_model, tmp_path):
    """A scaled-fp8 file may quantise the embedders and the head too (every Linear; comfy/ops.py scales any Linear
    that has a `scale_weight`). diffusers' time embedder casts the timestep to its first parameter's dtype, so
    those layers are dequantised at load, as diffusers never stores them in float8. Before: NotImplementedError
    ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn')."""
    from modules.util.fp8_scaled import ScaledFp8Linear, quantise_scaled_fp8
    from modules.util.lora.keys import original_to_diffusers_state_dict
    from tests.wan_file_layouts import dequantised
    base = tiny_model("wan2.1-t2v")
    original = transformer_to_original(_state(base, "transformer"), prefix=COMFY_PREFIX)
    scaled = {}
    for key, value in original.items():
        if key.endswith(".weight") and value.dim() == 2:
            scaled[key], scaled[key.removesuffix(".weight") + ".scale_weight"] = quantise_scaled_fp8(value)
        else:
            scaled[key] = value
    scaled[COMFY_PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / "every_linear_fp8_scaled.safetensors"
    save_file(scaled, str(path))
    _, model = _load(path, base)
    assert isinstance(model.blocks[0].ffn.net[0].proj, ScaledFp8Linear) and isinstance(model.proj_out,
                                                                                     ScaledFp8Linear)
    time_layer = model.condition_embedder.time_embedder.linear_1
    assert not isinstance(time_layer, ScaledFp8Linear) and time_layer.weight.dtype == torch.float32   # fp32 module
    reference = type(model).from_config(_config(base)).eval()
    reference.load_state_dict(original_to_diffusers_state_dict(dequantised(scaled)))
    expected = _forward(reference.to(torch.bfloat16), _config(base))
    torch.testing.assert_close(_forward(model, _config(base)), expected, atol=2e-2, rtol=2e-2)
