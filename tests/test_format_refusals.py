"""Small format defects (issue 14, section 4): convert_model's FLOAT_8 writes float8_e4m3fn (or refuses clearly), and
saving what musubi-tuner will not apply as KOHYA_LORA warns."""
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import LoraModule, lora_to_state_dict
from modules.util.lora.lycoris import LokrModule

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def convert_main():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import convert_model
        yield convert_model.main
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_float_8_writes_float8_e4m3fn_that_loads_back(convert_main, tiny_model, tmp_path):
    base = tiny_model("wan2.1-t2v")
    target = tmp_path / "fp8.safetensors"
    assert convert_main(["--input-name", str(base), "--output-model-format", "ORIGINAL",
                         "--output-model-destination", str(target), "--output-dtype", "FLOAT_8"]) == 0
    with safe_open(str(target), "pt") as file:
        dtypes = {key: file.get_slice(key).get_dtype() for key in file.keys()}
        query = file.get_tensor("blocks.0.self_attn.q.weight")
    assert dtypes["blocks.0.self_attn.q.weight"] == "F8_E4M3" and dtypes["patch_embedding.weight"] == "F8_E4M3"
    assert dtypes["blocks.0.self_attn.q.bias"] == "BF16" and dtypes["blocks.0.modulation"] == "BF16"
    assert set(dtypes.values()) == {"F8_E4M3", "BF16"}
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    loaded = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base), transformer=PartConfig(path=str(target))))
    original = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    # issue 20: an fp8 file's layers stay float8 in memory (upcast per layer when computing), so compare upcast
    assert loaded.transformer.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    read = loaded.transformer.blocks[0].attn1.to_q.weight.float()
    assert torch.equal(read, query.float())                                       # the fp8 values
    reference = original.transformer.blocks[0].attn1.to_q.weight
    assert (read - reference).abs().max() <= 0.07 * reference.abs().max()        # e4m3: 3 mantissa bits


@pytest.mark.parametrize("output_format", ["DIFFUSERS", "COMFY_LORA"])
def test_float_8_is_refused_where_it_cannot_be_written(convert_main, output_format, tmp_path, capsys):
    code = convert_main(["--input-name", str(tmp_path / "any"), "--output-model-format", output_format,
                         "--output-model-destination", str(tmp_path / "out"), "--output-dtype", "FLOAT_8"])
    assert code == 2
    assert "FLOAT_8" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_kohya_files_warn_about_what_musubi_tuner_ignores(caplog):
    lora = LoraModule(down=torch.ones(2, 8), up=torch.ones(8, 2), alpha=2.0)
    dora = LoraModule(down=torch.ones(2, 8), up=torch.ones(8, 2), alpha=2.0, dora_scale=torch.ones(8, 1))
    both = LokrModule(alpha=1.0, lokr_w1_a=torch.ones(2, 1), lokr_w1_b=torch.ones(1, 2), lokr_w2=torch.ones(4, 4))
    plain_lokr = LokrModule(alpha=1.0, lokr_w1=torch.ones(2, 2), lokr_w2=torch.ones(4, 4))
    name = "blocks.0.attn1.to_q"
    with caplog.at_level(logging.WARNING):
        lora_to_state_dict({name: lora}, ModelFormat.KOHYA_LORA)
        lora_to_state_dict({name: plain_lokr}, ModelFormat.KOHYA_LORA)
        lora_to_state_dict({name: dora}, ModelFormat.COMFY_LORA)               # ComfyUI applies dora_scale
    assert not [r for r in caplog.records if "musubi" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        lora_to_state_dict({name: dora, "blocks.0.attn1.to_k": both}, ModelFormat.KOHYA_LORA)
    messages = [r.getMessage() for r in caplog.records if "musubi" in r.getMessage()]
    assert len(messages) == 2
    assert "dora_scale" in messages[0] and "decompose_both" in messages[1]
