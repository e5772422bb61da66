"""Reading weight files by header and memory map (modules/modelLoader/wan/parts/tensor_files.py)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from modules.modelLoader.wan.parts.tensor_files import (ModelFileError, TensorInfo, detect_prefix, group_weight_files,
                                                        open_tensors, read_keys_and_shapes, read_metadata,
                                                        strip_prefix)


def _tensors():
    return {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
            "c": torch.zeros(3).to(torch.float8_e4m3fn)}


def test_safetensors_header_gives_shapes_dtypes_and_metadata(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    assert read_keys_and_shapes(path) == {"a.weight": TensorInfo((2, 3), "float32"), "b": TensorInfo((4,), "bfloat16"),
                                          "c": TensorInfo((3,), "float8_e4m3fn")}
    assert read_metadata(path) == {"format": "pt"}
    with open_tensors(path) as tensors:
        assert torch.equal(tensors["a.weight"], _tensors()["a.weight"])
        assert tensors["c"].dtype == torch.float8_e4m3fn


def test_truncated_file_is_reported_before_weights_load(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path))
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) - 3)
    with pytest.raises(ModelFileError, match="x.safetensors: truncated"):
        read_keys_and_shapes(path)
    with pytest.raises(ModelFileError, match="truncated"):
        open_tensors(path)


def _write_shards(folder, with_index: bool):
    tensors = {f"k{i}": torch.full((2,), float(i)) for i in range(3)}
    names = [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        save_file({f"k{i}": tensors[f"k{i}"]}, str(folder / name))
    if with_index:
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {f"k{i}": names[i] for i in range(3)}}))
    return names


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_set_reads_whole_and_missing_shard_is_named(tmp_path, with_index):
    names = _write_shards(tmp_path, with_index)
    start = tmp_path / (names[1] if not with_index else "diffusion_pytorch_model.safetensors.index.json")
    assert sorted(read_keys_and_shapes(start)) == ["k0", "k1", "k2"]
    assert [len(group) for group in group_weight_files(tmp_path)] == [3]
    with open_tensors(start) as tensors:
        assert tensors["k2"].tolist() == [2.0, 2.0]
    (tmp_path / names[2]).unlink()
    with pytest.raises(ModelFileError, match="00003-of-00003.safetensors: shard missing"):
        read_keys_and_shapes(start)


def test_truncated_shard_is_named(tmp_path):
    names = _write_shards(tmp_path, True)
    with open(tmp_path / names[0], "r+b") as file:
        file.truncate(os.path.getsize(tmp_path / names[0]) - 1)
    with pytest.raises(ModelFileError, match=f"{names[0]}: truncated"):
        read_keys_and_shapes(tmp_path / "diffusion_pytorch_model.safetensors.index.json")


def test_pth_flat_and_nested_dicts_of_tensors_are_read(tmp_path):
    flat, nested = tmp_path / "flat.pth", tmp_path / "nested.pth"
    torch.save(_tensors(), flat)
    torch.save({"state_dict": {"encoder": {"w": torch.ones(2, 2)}, "b": torch.zeros(1)}}, nested)
    assert read_keys_and_shapes(flat)["b"] == TensorInfo((4,), "bfloat16")
    assert read_keys_and_shapes(nested) == {"encoder.w": TensorInfo((2, 2), "float32"),
                                            "b": TensorInfo((1,), "float32")}
    with open_tensors([flat]) as tensors:
        assert torch.equal(tensors["a.weight"], _tensors()["a.weight"])


def test_pth_with_non_tensor_entries_is_refused(tmp_path):
    path = tmp_path / "ckpt.pth"
    torch.save({"w": torch.ones(1), "epoch": 3}, path)
    with pytest.raises(ModelFileError, match="ckpt.pth: entry 'epoch' is a int"):
        read_keys_and_shapes(path)
    torch.save([torch.ones(1)], path)
    with pytest.raises(ModelFileError, match="ckpt.pth: holds a list"):
        read_keys_and_shapes(path)


class _Planted:
    """Unpickling this calls open(marker, "w"): the classic code-execution pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("zip_format", [True, False])
def test_planted_pickle_is_refused_and_writes_nothing(tmp_path, zip_format):
    marker = tmp_path / "marker"
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save({"w": torch.ones(1), "x": _Planted(marker)}, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(ModelFileError, match="Wan2.1_VAE.pth: refused"):
        read_keys_and_shapes(path)
    with pytest.raises(ModelFileError, match="Wan2.1_VAE.pth: refused"):
        open_tensors(path)
    assert not marker.exists()


def test_diffusion_model_prefixes_are_stripped():
    keys = {"model.diffusion_model.blocks.0.x": 1, "model.diffusion_model.head.head.weight": 2}
    assert detect_prefix(keys) == "model.diffusion_model."
    assert strip_prefix(keys) == {"blocks.0.x": 1, "head.head.weight": 2}
    assert strip_prefix({"diffusion_model.a": 1, "diffusion_model.b": 2}) == {"a": 1, "b": 2}
    assert strip_prefix({"a": 1}) == {"a": 1}


def test_the_load_benchmarks_streaming_writer_writes_a_readable_file(tmp_path):
    from modules.benchmark.load_bench import write_streaming_safetensors
    path = tmp_path / "zeros.safetensors"
    specs = {"a": ((3, 5), torch.bfloat16), "b": ((), torch.float32), "c": ((0,), torch.float8_e4m3fn),
             "d": ((7,), torch.float8_e4m3fn)}
    size = write_streaming_safetensors(path, specs)
    assert size == path.stat().st_size
    assert read_keys_and_shapes(path) == {"a": TensorInfo((3, 5), "bfloat16"), "b": TensorInfo((), "float32"),
                                          "c": TensorInfo((0,), "float8_e4m3fn"),
                                          "d": TensorInfo((7,), "float8_e4m3fn")}
    with open_tensors(path) as tensors:
        assert torch.equal(tensors["a"], torch.zeros(3, 5, dtype=torch.bfloat16))
        assert tensors["d"].dtype == torch.float8_e4m3fn and tensors["c"].numel() == 0
