"""Saves write one tensor at a time (modules/util/safetensors_stream.py): the file is what safetensors writes, and
no save holds a second copy of the whole model while it writes."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver, _cast_tensor
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.fp8_scaled import quantise_scaled_fp8
from modules.util.lora.keys import diffusers_to_original_state_dict
from modules.util.safetensors_stream import Deferred, write_safetensors
from tests.host_memory_tracking import AliveBytes


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else tensor


def test_a_streamed_file_is_byte_for_byte_what_safetensors_writes(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(6, 4, generator=generator).bfloat16(), "b": torch.randn(7, generator=generator),
               "scalar": torch.tensor(3.0), "f8": torch.randn(4, 4, generator=generator).to(torch.float8_e4m3fn),
               "ids": torch.arange(5), "empty": torch.zeros(0, 3), "mask": torch.tensor([True, False]),
               "transposed": torch.randn(5, 3, generator=generator).t(), "half": torch.randn(3).half()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"), {"a": "b"})
    deferred = dict(tensors, w=Deferred(torch.bfloat16, (6, 4), lambda: tensors["w"].clone()))
    write_safetensors(deferred, tmp_path / "ours.safetensors", {"a": "b"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    with pytest.raises(ValueError, match="'w' was announced as torch.float32"):
        write_safetensors({"w": Deferred(torch.float32, (6, 4), lambda: tensors["w"])}, tmp_path / "bad.safetensors")


def _expected(transformer, output_format, dtype):
    """The file the save writes, built whole (as saves were built before they streamed)."""
    state = {k: _cast_tensor(k, v, dtype) for k, v in transformer.state_dict().items()}
    state = diffusers_to_original_state_dict(state)
    if output_format is ModelFormat.ORIGINAL_FP8_SCALED:
        out = {}
        for key, value in state.items():
            if key.startswith("blocks.") and key.endswith(".weight") and value.dim() == 2:
                out[key], out[key.removesuffix(".weight") + ".scale_weight"] = quantise_scaled_fp8(value)
            else:
                out[key] = value.to(torch.bfloat16) if value.is_floating_point() else value
        state = dict(out, scaled_fp8=torch.empty(0, dtype=torch.float8_e4m3fn))
    return state


@pytest.mark.parametrize("output_format,dtype", [(ModelFormat.ORIGINAL, torch.bfloat16),
                                                  (ModelFormat.ORIGINAL, torch.float8_e4m3fn),
                                                  (ModelFormat.ORIGINAL_FP8_SCALED, None)],
                         ids=["bf16", "fp8", "fp8-scaled"])
def test_a_single_file_save_holds_one_converted_tensor_at_a_time(tiny_model, tmp_path, output_format, dtype):
    """A save that casts made the whole cast state dict before writing it: a second model beside the live one."""
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    transformer = model.transformer
    parameters = tuple(transformer.state_dict().values())
    whole = sum(t.numel() * t.element_size() for t in parameters)
    largest = max(t.numel() for t in parameters) * 4
    with AliveBytes(existing=parameters) as counter:
        path, = WanBaseModelSaver().save(model, output_format, tmp_path / "t.safetensors", dtype)
    # at most one tensor's float32 worth (a weight on its way to float8 with its scale), far below the model
    assert counter.peak <= largest and 4 * largest < whole, (counter.peak, largest, whole)
    expected, written = _expected(transformer, output_format, dtype), load_file(str(path))
    assert written.keys() == expected.keys()
    assert all(written[k].dtype == v.dtype and torch.equal(_bits(written[k]), _bits(v)) for k, v in expected.items())
    with safe_open(str(path), "pt") as file:
        assert file.metadata()["modelspec.architecture"] == "wan_2_1_t2v"
