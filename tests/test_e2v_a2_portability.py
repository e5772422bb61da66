"""E2V images and A2 portability (issue 14, section 2): element images shrink without aliasing, the `a2` modes
reproduce SkyReels-A2's inference preprocessing, and a trained E2V fine-tune saved as an I2V diffusers folder is
laid out as transformers 4.x reads it as well."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from modules.model.e2v_condition import a2_mode, prepare_element_inputs, preprocess_element
from modules.util.config.E2VConfig import load_e2v_dataset_configs
from modules.util.demo_e2v import demo_e2v_config


def grid(size: int) -> np.ndarray:
    """1-pixel white lines every third pixel: detail that sampling without a low-pass filter turns into moire."""
    image = np.zeros((size, size, 3), np.uint8)
    image[:, ::3] = 255
    image[::3, :] = 255
    return image


@pytest.mark.parametrize("mode", ["resize", "center_crop", "pad_white", "letterbox"])
@pytest.mark.parametrize("reshape_mode", ["bicubic", "bilinear", "nearest"])
def test_shrinking_averages_instead_of_aliasing(mode, reshape_mode):
    """250 -> 32 pixels: an averaging filter gives a near-even grey at the grid's mean (std about 11; bicubic or
    bilinear sampling, as before, gives moire with a std near 90)."""
    source = grid(250)
    inside = preprocess_element(source, 32, 32, mode, reshape_mode).astype(np.float32)[4:-4, 4:-4]  # no bars
    assert abs(inside.mean() - source.mean()) < 5 and inside.std() < 15, (inside.mean(), inside.std())


def test_enlarging_keeps_the_reshape_mode():
    import cv2
    small = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    assert np.array_equal(preprocess_element(small, 32, 32, "resize", "nearest"),
                          cv2.resize(small, (32, 32), interpolation=cv2.INTER_NEAREST))
    assert np.array_equal(preprocess_element(small, 32, 32, "resize", "bicubic"),
                          cv2.resize(small, (32, 32), interpolation=cv2.INTER_CUBIC))


def pil_bicubic(array: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.asarray(Image.fromarray(array).resize((width, height), Image.Resampling.BICUBIC))


def test_a2_modes_reproduce_skyreels_a2_preprocessing():
    """A2 (models/utils.py): bars or cuts at the source size, int()-truncated, then PIL's bicubic resize."""
    image = np.random.default_rng(1).integers(0, 256, (20, 60, 3), dtype=np.uint8)   # 20 high, 60 wide
    # pad to square: (1 * 60 - 20) / 2 = 20 white rows above and below -> 60 x 60
    padded = np.full((60, 60, 3), 255, np.uint8)
    padded[20:40] = image
    assert np.array_equal(preprocess_element(image, 32, 32, "a2_pad"), pil_bicubic(padded, 32, 32))
    # crop to square: int(20 / 32 * 32) = 20 columns from (60 - 20) // 2 = 20
    assert np.array_equal(preprocess_element(image, 32, 32, "a2_crop"),
                          pil_bicubic(np.ascontiguousarray(image[:, 20:40]), 32, 32))
    # a tall source into a wide target: bars of int((48 / 32 * 31 - 20) / 2) = int(13.25) = 13 columns
    tall = np.random.default_rng(2).integers(0, 256, (31, 20, 3), dtype=np.uint8)
    wide = np.full((31, 20 + 2 * 13, 3), 255, np.uint8)
    wide[:, 13:33] = tall
    assert np.array_equal(preprocess_element(tall, 32, 48, "a2_pad"), pil_bicubic(wide, 32, 48))
    # a2: A2's infer.py pads every CLIP image and the first two VAE references, crops the third (the background)
    assert [a2_mode("a2", slot, "vae") for slot in range(3)] == ["a2_pad", "a2_pad", "a2_crop"]
    assert [a2_mode("a2", slot, "clip") for slot in range(3)] == ["a2_pad"] * 3
    assert a2_mode("center_crop", 2, "vae") == "center_crop"


def test_a2_is_a_dataset_preprocess_mode(tmp_path):
    raw = demo_e2v_config(tmp_path)
    raw["datasets"][0]["processors"]["vae"]["default_preprocess"] = "a2"
    raw["datasets"][0]["processors"]["clip"]["default_preprocess"] = "a2"
    for element in raw["datasets"][0]["elements"]:
        element.pop("clip")
    [dataset] = load_e2v_dataset_configs(raw)
    image = np.random.default_rng(3).integers(0, 256, (20, 60, 3), dtype=np.uint8)
    vae, clip = prepare_element_inputs(dataset, [image, image, image], 32, 32)
    as_uint8 = [((t.permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy() for t in vae]
    assert np.array_equal(as_uint8[0], preprocess_element(image, 32, 32, "a2_pad"))
    assert np.array_equal(as_uint8[2], preprocess_element(image, 32, 32, "a2_crop"))
    assert all(np.array_equal(c, preprocess_element(image, 32, 32, "a2_pad")) for c in clip)


# --- the I2V folder of an E2V fine-tune loads under transformers 4.x too ------------------------------------------

# transformers 4.x CLIPVisionModel: the layers live under `vision_model` (its CLIPVisionTransformer), the
# pre-encoder norm is spelled `pre_layrnorm`; position_ids is a non-persistent buffer (not in the file)
CLIP_4X_TOP = {"vision_model.embeddings.class_embedding", "vision_model.embeddings.patch_embedding.weight",
               "vision_model.embeddings.position_embedding.weight", "vision_model.pre_layrnorm.weight",
               "vision_model.pre_layrnorm.bias", "vision_model.post_layernorm.weight",
               "vision_model.post_layernorm.bias"}
CLIP_4X_LAYER = {f"{module}.{kind}" for module in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                                   "self_attn.out_proj", "layer_norm1", "mlp.fc1", "mlp.fc2",
                                                   "layer_norm2") for kind in ("weight", "bias")}


def test_an_e2v_fine_tune_saves_an_i2v_folder_that_transformers_4_reads(tiny_model, tmp_path):
    from diffusers import WanImageToVideoPipeline
    from modules.model.e2v_model import prepare_e2v_model
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSaver.WanModelSaver import WanModelSaver
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    from modules.util.enum.ModelFormat import ModelFormat
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v")),
                                                  image_encoder=PartConfig(path=str(tiny_model("wan2.1-i2v")))))
    prepare_e2v_model(model, load_e2v_dataset_configs(demo_e2v_config(tmp_path))[0])
    folder = tmp_path / "e2v_i2v"
    WanModelSaver().save(model, ModelFormat.DIFFUSERS, folder)

    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]          # 4.x: T5Tokenizer is the slow one
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]  # 4.x has no CLIPImageProcessorPil
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    config = json.loads((folder / "image_encoder" / "config.json").read_text())
    assert config["architectures"] == ["CLIPVisionModel"] and config["model_type"] == "clip_vision_model"
    processor = json.loads((folder / "image_processor" / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "CLIPImageProcessor"
    with safe_open(str(folder / "image_encoder" / "model.safetensors"), "pt") as file:
        keys = set(file.keys())
    layers = config["num_hidden_layers"]
    assert keys == CLIP_4X_TOP | {f"vision_model.encoder.layers.{n}.{k}" for n in range(layers) for k in CLIP_4X_LAYER}

    tokenizer_config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    assert not isinstance(tokenizer_config.get("extra_special_tokens", {}), list)   # 4.x calls .keys() on it
    assert not {"is_local", "local_files_only"} & set(tokenizer_config)
    from tokenizers import Tokenizer                      # what 4.x's T5TokenizerFast builds from tokenizer.json
    assert Tokenizer.from_file(str(folder / "tokenizer" / "tokenizer.json")).encode("a square").ids

    pipeline = WanImageToVideoPipeline.from_pretrained(folder)           # and the current versions still read it
    for name, value in model.image_encoder.state_dict().items():
        assert torch.equal(pipeline.image_encoder.state_dict()[name], value), name
    assert pipeline.transformer.config.in_channels == 36
