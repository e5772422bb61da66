"""read_state: tensors in their target dtype are used as read (a mapped .pth tensor in place), cast ones land in
storage allocated up front, and a mapped tensor whose pages were handed back still reads its file's values."""
import torch
from safetensors.torch import save_file

from modules.modelLoader.wan.parts.state_reads import TensorRead, read_state
from modules.modelLoader.wan.parts.tensor_files import open_tensors


def _weights():
    generator = torch.Generator().manual_seed(0)
    # 300 x 1000 float32: more than a page, so the release covers whole pages
    return {"a": torch.randn(300, 1000, generator=generator), "qkv": torch.randn(6, 4, generator=generator)}


def _reads(weights, dtype):
    reads = {"a": TensorRead("a", (300, 1000), dtype, "float32")}
    for index, name in enumerate(("q", "k", "v")):   # three parts of one fused tensor
        reads[name] = TensorRead("qkv", (2, 4), dtype, "float32",
                                 lambda tensor, _, index=index: tensor.chunk(3, dim=0)[index])
    return reads


def test_pth_tensors_in_their_dtype_are_used_in_place_and_cast_ones_keep_the_files_values(tmp_path):
    weights = _weights()
    path = tmp_path / "weights.pth"
    torch.save(weights, path)
    with open_tensors(path) as tensors:
        same = read_state(tensors, _reads(weights, torch.float32))
        assert same["a"].untyped_storage().data_ptr() == tensors["a"].untyped_storage().data_ptr()   # no copy
        cast = read_state(tensors, _reads(weights, torch.bfloat16))
        # the cast tensors own their storage, and the mapped pages handed back read the file again
        assert cast["a"].untyped_storage().data_ptr() != tensors["a"].untyped_storage().data_ptr()
        assert torch.equal(tensors["a"], weights["a"])
        assert torch.equal(same["a"], weights["a"])
    assert torch.equal(cast["a"], weights["a"].to(torch.bfloat16))
    assert torch.equal(cast["k"], weights["qkv"][2:4].to(torch.bfloat16))


def test_safetensors_reads_cast_into_their_own_storage(tmp_path):
    weights = _weights()
    path = tmp_path / "weights.safetensors"
    save_file(weights, str(path))
    with open_tensors(path) as tensors:
        state = read_state(tensors, _reads(weights, torch.float16))
    assert all(t.dtype == torch.float16 for t in state.values())
    assert torch.equal(state["a"], weights["a"].half()) and torch.equal(state["v"], weights["qkv"][4:].half())
