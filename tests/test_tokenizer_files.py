"""The UMT5 tokenizer is found where each layout keeps it (release google/umt5-xxl/, diffusers tokenizer/, ComfyUI's
spiece_model tensor, a spiece.model file), never downloaded unless allowed."""
import shutil

import pytest
import sentencepiece
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.modelLoader.wan.parts.tokenizer_files import find_tokenizer
from modules.util.tiny_model_files import spiece_model_tensor, train_sentencepiece

PROMPT = "the video of a blue square moving up"
HUB = "google/umt5-xxl"


@pytest.fixture(scope="module")
def spiece(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("spiece"))


def _sentencepiece_ids(model_file) -> list[int]:
    """What ComfyUI's SPieceTokenizer gives: the sentencepiece ids, then </s> (id 1)."""
    return sentencepiece.SentencePieceProcessor(model_file=str(model_file)).encode(PROMPT) + [1]


def test_release_and_diffusers_folders_give_the_folders_tokenizer(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    expected = AutoTokenizer.from_pretrained(folder / "tokenizer")(PROMPT).input_ids
    release = tmp_path / "Wan2.1-T2V-1.3B"
    shutil.copytree(folder / "tokenizer", release / "google" / "umt5-xxl")
    (release / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")   # the text encoder is not read for this
    for where in (release, folder, folder / "tokenizer"):
        assert find_tokenizer(where, [], False, HUB)(PROMPT).input_ids == expected


def _umt5_file(path, vocab: int, spiece_bytes: bytes | None = None):
    """A tiny UMT5 encoder with `vocab` embedding rows in ComfyUI's names (with the tokenizer inside, if given)."""
    from modules.util.tiny_models import make_text_encoder
    from modules.util.tiny_model_files import umt5_to_comfyui

    state = umt5_to_comfyui(make_text_encoder(vocab, seed=0).state_dict())
    if spiece_bytes is not None:
        state["spiece_model"] = spiece_model_tensor(spiece_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def test_comfyui_text_encoder_file_carries_the_tokenizer(spiece, tmp_path):
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spiece)).get_piece_size()
    encoder = _umt5_file(tmp_path / "models" / "text_encoders" / "umt5_xxl_fp16.safetensors", pieces,
                         spiece.read_bytes())
    # the ComfyUI models folder as the base, and the text-encoder file as the tokenizer path
    for where in (tmp_path / "models", encoder):
        tokenizer = find_tokenizer(where, [encoder], False, HUB)
        assert tokenizer(PROMPT).input_ids == _sentencepiece_ids(spiece)
    assert len(set(_sentencepiece_ids(spiece))) > 4   # the prompt is not all <unk>


def test_another_models_tokenizer_is_skipped_in_a_search_and_refused_when_named(spiece, tiny_model, tmp_path):
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spiece)).get_piece_size()
    models = tmp_path / "models"
    encoder = _umt5_file(models / "text_encoders" / "umt5_xxl_fp16.safetensors", pieces)
    other = tiny_model("wan2.1-t2v") / "tokenizer"   # 444 tokens: not this 200-row encoder's
    shutil.copytree(other, models / "another_model" / "tokenizer")
    (models / "wan" / "google" / "umt5-xxl").mkdir(parents=True)
    shutil.copy(spiece, models / "wan" / "google" / "umt5-xxl" / "spiece.model")
    tokenizer = find_tokenizer(models, [encoder], False, HUB)
    assert tokenizer(PROMPT).input_ids == _sentencepiece_ids(spiece)
    with pytest.raises(ModelFileError, match=r"444 tokens, but the text encoder .*umt5_xxl_fp16\.safetensors embeds "
                                             r"200: not this encoder's tokenizer; set model\.tokenizer\.path"):
        find_tokenizer(other, [encoder], False, HUB)


def test_a_sentencepiece_file_as_the_tokenizer_path(spiece, tmp_path):
    tokenizer = find_tokenizer(spiece, [], False, HUB)
    assert tokenizer(PROMPT).input_ids == _sentencepiece_ids(spiece)
    assert tokenizer.name_or_path == str(spiece)
    # it saves as a diffusers tokenizer/ folder (convert_model, the savers) that loads back the same
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert AutoTokenizer.from_pretrained(tmp_path / "tokenizer")(PROMPT).input_ids == _sentencepiece_ids(spiece)


def test_no_tokenizer_names_what_to_point_at_and_downloads_nothing(tmp_path, monkeypatch):
    encoder = tmp_path / "umt5_xxl_fp16.safetensors"
    save_file({"shared.weight": torch.zeros(4, 2)}, str(encoder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFileError) as error:
        find_tokenizer(tmp_path, [encoder], False, HUB)
    message = str(error.value)
    assert "model.tokenizer.path" in message and "umt5_xxl_fp16.safetensors" in message
    assert "model.allow_download: true" in message and HUB in message


def test_a_spiece_model_tensor_that_is_not_bytes_is_refused_naming_the_file(tmp_path):
    encoder = tmp_path / "umt5_xxl_fp16.safetensors"
    save_file({"spiece_model": torch.zeros(8)}, str(encoder))
    with pytest.raises(ModelFileError, match=r"umt5_xxl_fp16\.safetensors.*'spiece_model' is float32"):
        find_tokenizer(None, [encoder], False, HUB)
