"""Every form an image encoder comes in loads, with the preprocessor that goes with it, under both loaders (a
diffusers base; an official release base, read by content), in `train` and `sample`, and the GUI's part picker says
what it holds: a whole diffusers I2V folder, its image_encoder/ subfolder (preprocessor in ../image_processor/), a
lone image_encoder/ folder, the official CLIP .pth, ComfyUI's clip_vision_h.safetensors, a hub id. Without a
preprocessor of its own, an encoder gets Wan's own CLIP preprocessing (wan/modules/clip.py)."""
import shutil

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.ui.model_parts import describe_for
from modules.util.config.ModelConfig import ModelConfig
from modules.util.tiny_model_files import write_comfy_encoders, write_official_encoders
from tests.test_image_encoder_files import wan_preprocessed
from tests.wan_file_layouts import vae21_to_original, write_release_transformer

HUB_ID = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
# form -> whether the encoder comes with the diffusers folder's own preprocessor (else Wan's)
FORMS = {"model folder": True, "image_encoder subfolder": True, "lone image_encoder folder": False,
         "official .pth": False, "clip_vision_h": False, "hub id": True}


@pytest.fixture(scope="module")
def forms(tiny_model, tmp_path_factory):
    """form -> the path (or hub id) a user names; the tiny CLIP is 24 wide, no released width, so the single files
    get its config.json beside them (as a CLIP folder of one's own)."""
    i2v = tiny_model("wan2.1-i2v")
    root = tmp_path_factory.mktemp("image-encoders")
    shutil.copytree(i2v / "image_encoder", root / "lone" / "image_encoder")
    official = root / "official"
    write_official_encoders(i2v, official, with_clip=True)
    comfy = write_comfy_encoders(i2v, root / "comfy")["image_encoder"]
    for folder in (official, comfy.parent):
        shutil.copy(i2v / "image_encoder" / "config.json", folder / "config.json")
    hub_cache = root / "hub"
    snapshot = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / ("0" * 40)
    for part in ("image_encoder", "image_processor"):
        shutil.copytree(i2v / part, snapshot / part)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    return {"model folder": str(i2v), "image_encoder subfolder": str(i2v / "image_encoder"),
            "lone image_encoder folder": str(root / "lone" / "image_encoder"),
            "official .pth": str(official / CLIP_FILE), "clip_vision_h": str(comfy), "hub id": HUB_ID,
            "hub cache": str(hub_cache)}


@pytest.fixture(scope="module")
def release(tiny_model, tmp_path_factory):
    """Wan2.1-T2V as the official release ships it (shards, Wan2.1_VAE.pth, the T5 .pth, google/umt5-xxl/)."""
    t2v = tiny_model("wan2.1-t2v")
    folder = tmp_path_factory.mktemp("release") / "Wan2.1-T2V-tiny"
    folder.mkdir()
    write_release_transformer(t2v, folder)
    vae = load_file(str(t2v / "vae" / "diffusion_pytorch_model.safetensors"))
    torch.save(vae21_to_original(vae), folder / "Wan2.1_VAE.pth")
    write_official_encoders(t2v, folder, with_clip=False)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_model):
    i2v = tiny_model("wan2.1-i2v")
    return (CLIPVisionModel.from_pretrained(i2v / "image_encoder").eval(),
            CLIPImageProcessor.from_pretrained(i2v / "image_processor"))


# a picture that is not square: the diffusers processor crops it, Wan's stretches it, so they differ
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 56, 3), dtype=np.uint8))


def _check(model, reference, own_processor: bool) -> None:
    encoder, processor = reference
    pixels = processor(images=IMAGE, return_tensors="pt").pixel_values
    with torch.no_grad():
        torch.testing.assert_close(model.image_encoder(pixels, output_hidden_states=True).hidden_states[-2],
                                   encoder(pixels, output_hidden_states=True).hidden_states[-2], atol=1e-6, rtol=0)
    got = model.image_processor(images=IMAGE, return_tensors="pt").pixel_values
    expected = pixels if own_processor else wan_preprocessed(IMAGE, encoder.config.image_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("base", ["diffusers", "release"])
def test_every_image_encoder_form_loads_with_its_preprocessor(forms, release, reference, tiny_model, monkeypatch,
                                                               base):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", forms["hub cache"])
    base_model = tiny_model("wan2.1-t2v") if base == "diffusers" else release
    # under the release base, one form of each kind the model plan takes (a folder, a file, a hub id): the files
    # load through the same function under both bases
    forms_here = FORMS if base == "diffusers" else ("image_encoder subfolder", "official .pth", "hub id")
    for form in forms_here:
        own_processor = FORMS[form]
        config = ModelConfig(base_model_name=str(base_model), allow_download=form == "hub id",
                             image_encoder={"path": forms[form]})
        _check(WanBaseModelLoader().load(config), reference, own_processor)


def test_the_part_picker_says_what_each_form_holds(forms):
    lines = {form: describe_for("image_encoder", forms[form]) for form in FORMS}
    assert lines == {"model folder": "image_encoder: diffusers, fp32",
                     "image_encoder subfolder": "image_encoder: diffusers, fp32",
                     "lone image_encoder folder": "image_encoder: diffusers, fp32",
                     "official .pth": "image_encoder: wan, fp32", "clip_vision_h": "image_encoder: comfyui, fp32",
                     "hub id": "hub id: fetched when the run starts (needs model.allow_download)"}
    assert describe_for("vae", forms["official .pth"]) == "not usable: holds image_encoder, not vae"


def test_train_and_sample_take_a_diffusers_models_image_encoder_subfolder(forms, release, reference, tiny_model,
                                                                          squares_dataset, tmp_path):
    """The folder a user points at (`train --image_encoder DIR/image_encoder`): its preprocessor is in
    DIR/image_processor/."""
    from tests.learning import train
    from tests.wan_file_layouts import sample_tiny_video
    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, steps=1,
                    overrides=[f"model.image_encoder.path={forms['image_encoder subfolder']}"])
    _check(trainer.model, reference, own_processor=True)
    assert sample_tiny_video(release, tmp_path / "samples", ["--image-encoder", forms["lone image_encoder folder"]]) \
        == 5
