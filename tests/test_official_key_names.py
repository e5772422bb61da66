"""The files the tests write "in the official layouts" carry exactly the names and shapes of the official Wan modules'
state dicts, and a file with exactly those names and shapes is read.

The reference (tests/fixtures/official_wan_key_names.json) was taken from the official modules themselves
(Wan-Video/Wan2.1 and Wan2.2: wan/modules/model.py WanModel, vae.py / vae2_2.py WanVAE_, t5.py T5Encoder, clip.py
XLMRobertaCLIP) built at the tiny sizes of modules/util/tiny_models.py: the fixture writers invert diffusers' and
our own conversions, so an inversion error would otherwise pass every layout test and fail on a real file."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.modelLoader.wan.parts.image_encoder_files import plan_image_encoder
from modules.modelLoader.wan.parts.recognise import find_parts
from modules.modelLoader.wan.parts.text_encoder_files import plan_text_encoder
from modules.modelLoader.wan.parts.transformer_files import check_transformer_keys
from modules.modelLoader.wan.parts.vae_files import check_vae_keys, vae_config_for
from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
from modules.util.tiny_model_files import hf_to_wan_clip, umt5_to_wan_t5, xlm_roberta_text_tower
from tests.wan_file_layouts import transformer_to_original, vae21_to_original, vae22_to_original

_FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "official_wan_key_names.json").read_text())
OFFICIAL = {label.split(" (")[0]: {name: tuple(shape) for name, shape in names.items()}
            for label, names in _FIXTURE.items() if not label.startswith("_")}
TRANSFORMERS = {"wan2.1-t2v": "transformer wan2.1 t2v", "wan2.1-i2v": "transformer wan2.1 i2v",
                "wan2.1-flf2v": "transformer wan2.1 flf2v", "wan2.2-ti2v-5b": "transformer wan2.2 ti2v-5b",
                "wan2.2-t2v-a14b": "transformer wan2.2 t2v-a14b expert",
                "wan2.2-i2v-a14b": "transformer wan2.2 i2v-a14b expert", "wan2.1-vace": "transformer wan2.1 vace"}
# the official I2V / FLF2V image projection is 1280 wide (MLPProj(1280, dim)) whatever the CLIP; the tiny model's 24
IMAGE_PROJECTION = "img_emb."


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in state.items()}


def _state(folder: Path, part: str) -> dict[str, torch.Tensor]:
    [weights] = sorted((folder / part).glob("*.safetensors"))
    return load_file(str(weights))


def _same(ours: dict[str, tuple], official: dict[str, tuple], skip_shapes=()) -> None:
    assert sorted(set(official) - set(ours)) == [] and sorted(set(ours) - set(official)) == []
    wrong = {name: (ours[name], shape) for name, shape in official.items()
             if ours[name] != shape and not name.startswith(skip_shapes)}
    assert wrong == {}


@pytest.mark.parametrize("variant", list(TRANSFORMERS))
def test_transformer_writer_gives_the_official_names(tiny_model, variant):
    folder = tiny_model(variant)
    for expert in ("transformer", "transformer_2") if "a14b" in variant else ("transformer",):
        _same(_shapes(transformer_to_original(_state(folder, expert))), OFFICIAL[TRANSFORMERS[variant]],
              skip_shapes=(IMAGE_PROJECTION,))


@pytest.mark.parametrize("variant,official", [("wan2.1-t2v", "vae wan2.1"), ("wan2.2-ti2v-5b", "vae wan2.2")])
def test_vae_writers_give_the_official_names_and_shapes(tiny_model, variant, official):
    state = _state(tiny_model(variant), "vae")
    to_original = vae22_to_original if official.endswith("2.2") else vae21_to_original
    _same(_shapes(to_original(state)), OFFICIAL[official])


def test_text_and_image_encoder_writers_give_the_official_names_and_shapes(tiny_model):
    folder = tiny_model("wan2.1-i2v")
    t5 = _shapes(umt5_to_wan_t5(_state(folder, "text_encoder")))
    official_t5 = dict(OFFICIAL["text encoder"])
    official_t5["token_embedding.weight"] = t5["token_embedding.weight"]   # the vocabulary is the tokenizer's
    _same(t5, official_t5)
    vision = _state(folder, "image_encoder")
    width = vision["vision_model.post_layernorm.weight"].shape[0]
    clip = hf_to_wan_clip(vision, torch.zeros(width // 2, width))
    clip.update(xlm_roberta_text_tower(embed_dim=width // 2))
    _same(_shapes(clip), OFFICIAL["image encoder"])


def _zeros_file(path: Path, shapes: dict[str, tuple[int, ...]], dtype=torch.float16) -> Path:
    save_file({name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}, str(path))
    return path


@pytest.mark.parametrize("variant", list(TRANSFORMERS))
def test_a_transformer_file_with_the_official_names_is_read_whole(tmp_path, variant):
    """Recognised as the official layout, every tensor mapped (nothing left over), the config found from the
    shapes (the official image projection's 1280 included)."""
    shapes = OFFICIAL[TRANSFORMERS[variant]]
    path = _zeros_file(tmp_path / "diffusion_pytorch_model.safetensors", shapes)
    [found] = find_parts(path)
    assert (found.part, found.layout, found.dtype) == ("transformer", "wan", "fp16")
    assert sorted(found.detail.names.values()) == sorted(shapes)
    config = transformer_config_from_shapes(found.detail.shapes, str(path), {"num_attention_heads": 2,
                                                                             "attention_head_dim": 32})
    check_transformer_keys(found.detail, config, str(path))
    assert (config["in_channels"], config["out_channels"]) == (shapes["patch_embedding.weight"][1],
                                                               shapes["head.head.weight"][0] // 4)
    assert config["image_dim"] == (1280 if "img_emb.proj.0.weight" in shapes else None)
    assert (config["pos_embed_seq_len"] is not None) == ("flf2v" in variant)


@pytest.mark.parametrize("official", ["vae wan2.1", "vae wan2.2"])
def test_a_vae_file_with_the_official_names_is_read_whole(tmp_path, official):
    path = tmp_path / ("Wan2.2_VAE.pth" if official.endswith("2.2") else "Wan2.1_VAE.pth")
    torch.save({name: torch.zeros(shape) for name, shape in OFFICIAL[official].items()}, path)
    [found] = find_parts(path)
    assert (found.part, found.layout) == ("vae", official.split()[-1])
    assert sorted(found.detail.names.values()) == sorted(OFFICIAL[official])
    check_vae_keys(found.detail, vae_config_for(found.detail, None), str(path))


def test_official_text_and_image_encoder_files_are_read_whole(tmp_path):
    t5 = dict(OFFICIAL["text encoder"])
    t5["token_embedding.weight"] = (512, t5["norm.weight"][0])
    path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save({name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in t5.items()}, path)
    [found] = find_parts(path)
    assert (found.part, found.layout, found.dtype) == ("text_encoder", "wan", "bf16")
    names, config = plan_text_encoder(found.keys, "wan", str(path))
    assert sorted(names.names.values()) == sorted(t5) and config.num_layers == 2
    path = tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save({name: torch.zeros(shape) for name, shape in OFFICIAL["image encoder"].items()}, path)
    [found] = find_parts(path)
    assert (found.part, found.layout) == ("image_encoder", "wan")   # the XLM-RoBERTa text tower is not a T5
    sources, settings = plan_image_encoder(found.keys, "wan", str(path), {"num_attention_heads": 2})
    visual = {name for name in OFFICIAL["image encoder"] if name.startswith("visual.") and name != "visual.head"}
    assert {source.key for source in sources.values()} == visual
    assert (settings["image_size"], settings["patch_size"], settings["num_hidden_layers"]) == (32, 8, 2)


# config.json of the official transformer folders: what diffusers' save_config writes for WanModel (Wan2.1 / Wan2.2
# wan/modules/model.py: its __init__ arguments less `ignore_for_config` = patch_size, cross_attn_norm, qk_norm,
# text_dim, window_size), e.g. Wan-AI/Wan2.1-T2V-14B's {"_class_name": "WanModel", "dim": 5120, ...}
OFFICIAL_CONFIG_KEYS = {"_class_name", "_diffusers_version", "dim", "eps", "ffn_dim", "freq_dim", "in_dim",
                        "model_type", "num_heads", "num_layers", "out_dim", "text_len"}


@pytest.mark.parametrize("variant,model_type", [("wan2.1-t2v", "t2v"), ("wan2.1-i2v", "i2v"),
                                                ("wan2.1-flf2v", "flf2v"), ("wan2.2-ti2v-5b", "ti2v"),
                                                ("wan2.2-t2v-a14b", "t2v"), ("wan2.2-i2v-a14b", "i2v")])
def test_the_official_config_writer_gives_the_release_fields(tiny_model, variant, model_type):
    from tests.wan_file_layouts import official_transformer_config
    config = official_transformer_config(json.loads((tiny_model(variant) / "transformer" / "config.json").read_text()))
    assert set(config) == OFFICIAL_CONFIG_KEYS
    assert (config["_class_name"], config["model_type"], config["dim"]) == ("WanModel", model_type, 64)
