"""Encoder files that are not plain tensors are refused, naming the file, before anything runs; a folder of
ComfyUI / official encoder files is recognised part by part, with layout and dtype."""
import pytest
import torch
from safetensors.torch import load_file

from modules.modelLoader.wan.parts.recognise import find_parts
from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.modelLoader.wan.parts.text_encoder_files import load_text_encoder
from modules.util.tiny_model_files import umt5_to_wan_t5, write_comfy_encoders, write_official_encoders


class _WritesMarker:
    """Unpickling this runs `exec`, which would write the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("name", ["models_t5_umt5-xxl-enc-bf16.pth",
                                  "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"])
def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "marker.txt"
    path = tmp_path / name
    torch.save({"token_embedding.weight": torch.zeros(2, 2), "payload": _WritesMarker(marker)}, path)
    with pytest.raises(ModelFileError, match=rf"{name.replace('.', '[.]')}: refused: the file needs more than "
                                              rf"tensors"):
        find_parts(path)
    with pytest.raises(ModelFileError, match="refused"):
        load_text_encoder([path], "wan", torch.float32)
    assert not marker.exists()


def test_non_tensor_content_is_refused_naming_the_file(tiny_model, tmp_path):
    state = umt5_to_wan_t5(load_file(str(tiny_model("wan2.1-t2v") / "text_encoder" / "model.safetensors")))
    state["notes"] = "trained by someone"   # a str: the restricted loader builds it, but it is no weight
    path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(state, path)
    with pytest.raises(ModelFileError, match=r"models_t5_umt5-xxl-enc-bf16\.pth: entry 'notes' is a str, not a "
                                             r"tensor"):
        load_text_encoder([path], "wan", torch.float32)


def test_encoder_folders_are_recognised_by_content(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-i2v")
    write_official_encoders(folder, tmp_path / "official")
    write_comfy_encoders(folder, tmp_path / "comfy", fp8_scaled=True)
    # file names carry no meaning: the official files renamed still read as what they hold
    (tmp_path / "official" / "models_t5_umt5-xxl-enc-bf16.pth").rename(tmp_path / "official" / "a.pth")
    found = {(p.part, p.layout, p.dtype) for p in find_parts(tmp_path / "official")}
    assert found == {("text_encoder", "wan", "fp32"), ("image_encoder", "wan", "fp32")}
    found = {(p.part, p.layout, p.dtype) for p in find_parts(tmp_path / "comfy")}
    assert found == {("text_encoder", "comfyui", "fp8_scaled"), ("image_encoder", "comfyui", "fp32")}
