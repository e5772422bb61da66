"""The CLIP image encoder from the files users hold (official Wan CLIP .pth, open_clip, ComfyUI clip_vision_h)
gives the penultimate hidden states (what Wan conditions on) of the diffusers folder's image_encoder."""
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from modules.modelLoader.wan.parts.image_encoder_files import (image_encoder_config, load_image_encoder,
                                                               recognise_image_encoder)
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, read_keys_and_shapes
from modules.modelLoader.wan.parts.text_encoder_files import recognise_text_encoder
from modules.util.tiny_model_files import (clip_vision_to_comfyui, hf_to_open_clip_names, hf_to_wan_clip,
                                           xlm_roberta_text_tower)


@pytest.fixture(scope="module")
def reference(tiny_model):
    folder = tiny_model("wan2.1-i2v")
    model = CLIPVisionModel.from_pretrained(folder / "image_encoder", torch_dtype=torch.float32)
    processor = CLIPImageProcessor.from_pretrained(folder / "image_processor")
    state = load_file(str(folder / "image_encoder" / "model.safetensors"))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
    return model, processor, state, image


def _penultimate(model, processor, image) -> torch.Tensor:
    pixels = processor(images=image, return_tensors="pt").pixel_values
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]


def _write(tmp_path, layout, state):
    width = state["vision_model.post_layernorm.weight"].shape[0]
    projection = torch.randn(width // 2, width)
    if layout == "comfyui":
        path = tmp_path / "clip_vision_h.safetensors"
        save_file(clip_vision_to_comfyui(state, projection), str(path))
        return path
    converted = hf_to_wan_clip(state, projection) if layout == "wan" else hf_to_open_clip_names(state, projection)
    converted.update(xlm_roberta_text_tower(embed_dim=width // 2))   # the official file's text tower: ignored
    path = tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save(converted, path)
    return path


@pytest.mark.parametrize("layout", ["wan", "open_clip", "comfyui"])
def test_image_encoder_layouts_give_the_diffusers_penultimate_hidden_states(reference, tmp_path, layout):
    model, processor, state, image = reference
    path = _write(tmp_path, layout, state)
    keys = read_keys_and_shapes(path)
    assert recognise_image_encoder(keys) == layout
    assert recognise_text_encoder(keys) is None   # the XLM-RoBERTa tower's names resemble Wan's T5
    # the tiny tower's head count is in no tensor shape: given alone, the rest (GELU, not transformers' default
    # quick_gelu) is ViT-H/14's
    heads = {"num_attention_heads": model.config.num_attention_heads}
    loaded, loaded_processor = load_image_encoder([path], layout, torch.float32, config=heads)
    expected = _penultimate(model, processor, image)
    torch.testing.assert_close(_penultimate(loaded, processor, image), expected, atol=1e-6, rtol=0)
    # no preprocessor beside the file: Wan's own preprocessing at the tower's size
    torch.testing.assert_close(loaded_processor(images=image, return_tensors="pt").pixel_values,
                               wan_preprocessed(image, 32), atol=1e-5, rtol=0)


def wan_preprocessed(image, size: int) -> torch.Tensor:
    """Wan-Video/Wan2.1 wan/modules/clip.py `CLIPModel.visual`: the whole picture resized to size x size (bicubic,
    no crop), then normalised with the OpenAI CLIP mean / std."""
    stretched = np.asarray(image.convert("RGB").resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    return torch.from_numpy(((stretched - mean) / std).astype(np.float32)).permute(2, 0, 1)[None]


def test_a_tower_of_unknown_width_without_a_config_names_what_to_provide(reference, tmp_path):
    _, _, state, _ = reference
    path = _write(tmp_path, "wan", state)
    with pytest.raises(ModelFileError, match=r"vit-huge-14\.pth.*24 wide.*config\.json"):
        load_image_encoder([path], "wan", torch.float32)


def test_a_config_json_beside_the_file_gives_the_head_count(reference, tmp_path):
    model, processor, state, image = reference
    path = _write(tmp_path, "comfyui", state)
    model.config.to_json_file(tmp_path / "config.json")
    loaded, _ = load_image_encoder([path], "comfyui", torch.float32)
    assert loaded.config.num_attention_heads == model.config.num_attention_heads
    torch.testing.assert_close(_penultimate(loaded, processor, image), _penultimate(model, processor, image),
                               atol=1e-6, rtol=0)


def test_released_vit_h_14_config_comes_back_from_its_shapes():
    shapes = {"embeddings.patch_embedding.weight": (1280, 3, 14, 14),
              "embeddings.position_embedding.weight": (257, 1280)}
    for i in range(32):
        shapes[f"encoder.layers.{i}.mlp.fc1.weight"] = (5120, 1280)
    config = image_encoder_config(shapes, "clip")
    assert (config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"], config["image_size"],
            config["patch_size"], config["intermediate_size"], config["hidden_act"]) == (1280, 16, 32, 224, 14, 5120,
                                                                                         "gelu")


def test_a_missing_layer_tensor_is_named_before_weights_load(reference, tmp_path):
    _, _, state, _ = reference
    broken = {k: v for k, v in state.items() if k != "vision_model.encoder.layers.1.mlp.fc2.bias"}
    path = tmp_path / "clip_vision_h.safetensors"
    save_file(broken, str(path))
    with pytest.raises(ModelFileError, match=r"clip_vision_h\.safetensors.*1 missing.*layers\.1\.mlp\.fc2\.bias"):
        load_image_encoder([path], "comfyui", torch.float32, config={"num_attention_heads": 2})


@pytest.mark.parametrize("layout", ["wan", "open_clip", "comfyui"])
def test_the_real_vit_h_14_file_names_and_shapes_plan_the_released_tower(layout):
    """A real-size tower (meta tensors) in each layout is recognised and planned with the released config."""
    import json

    from accelerate import init_empty_weights

    from modules.modelLoader.wan.parts.image_encoder_files import CONFIG_DIR, plan_image_encoder
    from modules.modelLoader.wan.parts.tensor_files import TensorInfo
    from transformers import CLIPVisionConfig

    released = json.loads((CONFIG_DIR / "clip-vit-h-14.json").read_text())
    with init_empty_weights():
        state = {f"vision_model.{k}": v for k, v in CLIPVisionModel(CLIPVisionConfig(**released)).state_dict().items()}
    projection = torch.empty(1024, 1280, device="meta")
    converted = {"comfyui": lambda: clip_vision_to_comfyui(state, projection),
                 "wan": lambda: hf_to_wan_clip(state, projection),
                 "open_clip": lambda: hf_to_open_clip_names(state, projection)}[layout]()
    keys = {k: TensorInfo(tuple(v.shape), "float16") for k, v in converted.items()}
    if layout == "wan":
        assert keys["visual.transformer.31.attn.to_qkv.weight"].shape == (3840, 1280)
        assert keys["visual.pos_embedding"].shape == (1, 257, 1280)
    assert recognise_image_encoder(keys) == layout
    _, config = plan_image_encoder(keys, layout, "clip", None)
    assert {k: config[k] for k in released if k != "architectures"} == \
        {k: v for k, v in released.items() if k != "architectures"}


def test_a_diffusers_image_encoder_file_takes_its_folders_config_and_processor(reference, tiny_model):
    """model.image_encoder.path at a diffusers folder's image_encoder/model.safetensors: the config.json beside it
    gives the head count, image_processor/ the processor."""
    model, processor, _, image = reference
    path = tiny_model("wan2.1-i2v") / "image_encoder" / "model.safetensors"
    assert recognise_image_encoder(read_keys_and_shapes(path)) == "comfyui"
    loaded, loaded_processor = load_image_encoder([path], "comfyui", torch.float32)
    assert loaded_processor.to_dict() == processor.to_dict()
    torch.testing.assert_close(_penultimate(loaded, loaded_processor, image), _penultimate(model, processor, image),
                               atol=1e-6, rtol=0)
