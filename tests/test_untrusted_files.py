"""Issue 15: files a user names are never unpickled, and forged media never exhaust memory. Every place a user gives
a weight file refuses a planted pickle (one that would write a marker file when unpickled) with a message naming
the file and saying only safetensors are read; forged .npz clips are skipped with a reason, from their headers."""
import io
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.validation import check_paths
from modules.util.video_io import UnreadableMediaError, probe_media

ONLY_SAFETENSORS = "only safetensors files are read"


class Payload:
    """Unpickling this writes the marker file: proof that nothing unpickled it when the marker is absent."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


@pytest.fixture
def trap(tmp_path):
    """`plant(path)`: writes a torch-format pickle (a zip, as torch.save writes .pt/.bin/.ckpt) at `path`; the
    marker exists afterwards only if something unpickled one."""
    marker = tmp_path / "UNPICKLED"

    def plant(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"weight": Payload(marker)}, path)
        return path

    # the trap is live: unpickling it does write the marker
    live = plant(tmp_path / "live.pt")
    torch.load(live, weights_only=False)
    assert marker.is_file()
    marker.unlink()
    yield plant
    assert not marker.exists(), "a planted pickle was unpickled"


@pytest.mark.parametrize("part,file_name", [("transformer", "diffusion_pytorch_model.bin"),
                                            ("text_encoder", "pytorch_model.bin")])
def test_a_model_folder_with_pickled_weights_is_refused(part, file_name, tiny_model, trap, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("wan2.1-t2v"), folder)
    for weights in (folder / part).glob("*.safetensors*"):
        weights.unlink()
    trap(folder / part / file_name)
    with pytest.raises(ModelLoadError, match=rf"{file_name}' holds pickled weights; {ONLY_SAFETENSORS}"):
        WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def test_a_pickled_single_file_transformer_is_refused(tiny_model, trap, tmp_path):
    checkpoint = trap(tmp_path / "wan_t2v.ckpt")
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}",
                                    f"model.transformer.path={checkpoint}"])
    with pytest.raises(ConfigError, match=rf"model.transformer.path: '{checkpoint}' is a .ckpt file; {ONLY_SAFETENSORS}"):
        check_paths(config)
    with pytest.raises(ModelLoadError, match=ONLY_SAFETENSORS):
        WanBaseModelLoader().load(config.model)


@pytest.mark.parametrize("name", ["lora.pt", "lora.safetensors"])  # a pickle renamed .safetensors is caught too
def test_a_pickled_lora_is_refused_everywhere_a_lora_is_read(name, tiny_model, trap, tmp_path):
    from modules.model.e2v_lora import read_e2v_lora
    from modules.modelSampler.sampling_io import apply_lora_files
    from modules.util.lora.convert import convert_lora_files
    from modules.util.lora.formats import load_lora_file
    from modules.util.enum.ModelFormat import ModelFormat

    lora = trap(tmp_path / name)
    expected = rf"'{lora}' is (a .pt file|a zip archive \(torch's pickle format\)); {ONLY_SAFETENSORS}"
    with pytest.raises(ValueError, match=expected):
        load_lora_file(lora)
    with pytest.raises(ValueError, match=expected):
        read_e2v_lora(lora)  # an E2V LoRA
    with pytest.raises(ValueError, match=expected):
        convert_lora_files(lora, tmp_path / "converted.safetensors", ModelFormat.KOHYA_LORA, None)
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    with pytest.raises(ValueError, match=expected):
        apply_lora_files(model, [(lora, 1.0)])  # scripts/sample.py --lora
    # lora.init_from: refused before any model loads
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}", f"lora.init_from={lora}"])
    with pytest.raises(ConfigError, match=r"lora.init_from: " + expected):
        check_paths(config)


def test_an_npz_clip_holding_pickled_objects_is_skipped(trap, tmp_path):
    marker_payload = Payload(tmp_path / "UNPICKLED")
    path = tmp_path / "clip.npz"
    np.savez(path, frames=np.array([marker_payload], dtype=object))
    with pytest.raises(UnreadableMediaError, match="pickled Python objects, which are never loaded"):
        probe_media(path)


# ---- forged .npz headers -------------------------------------------------------------------------------------

def forged_npz(path, shape, data_bytes: int = 64, fps=None):
    """An .npz whose frame array's header declares `shape` but which stores only `data_bytes` bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("frames.npy", header.getvalue() + b"\0" * data_bytes)
        if fps is not None:
            fps_file = io.BytesIO()
            np.save(fps_file, np.array(fps))
            archive.writestr("fps.npy", fps_file.getvalue())
    return path


@pytest.mark.parametrize("shape,reason", [
    ((10 ** 9, 1, 1, 3), r"declares \(1000000000, 1, 1, 3\) \(3000000000 bytes\), but the archive stores 64"),
    ((4, 2 ** 19, 2 ** 19, 3), r"declares \(4, 524288, 524288, 3\) \(3072 GiB\), more than the 16 GiB"),
])
def test_an_npz_declaring_huge_frames_is_skipped_without_allocating(shape, reason, tmp_path):
    import tracemalloc
    path = forged_npz(tmp_path / "forged.npz", shape)
    tracemalloc.start()
    try:
        with pytest.raises(UnreadableMediaError, match=reason):
            probe_media(path)
        assert tracemalloc.get_traced_memory()[1] < 2 ** 24  # nothing near the declared size was allocated
    finally:
        tracemalloc.stop()


def test_an_npz_with_an_infinite_fps_is_skipped(tmp_path):
    path = tmp_path / "inf.npz"
    np.savez(path, frames=np.zeros((9, 32, 32, 3), np.uint8), fps=np.array(np.inf))
    with pytest.raises(UnreadableMediaError, match="'fps' entry must be one positive number"):
        probe_media(path)


def test_forged_clips_are_skipped_with_reasons_by_the_scan(tmp_path, caplog):
    """One warning each, naming the file and the reason; the good clip trains."""
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "good.npz", frames=np.zeros((9, 32, 32, 3), np.uint8), fps=np.array(16.0))
    forged_npz(data / "billion.npz", (10 ** 9, 1, 1, 3))
    forged_npz(data / "terabytes.npz", (4, 2 ** 19, 2 ** 19, 3))
    np.savez(data / "inf.npz", frames=np.zeros((9, 32, 32, 3), np.uint8), fps=np.array(np.inf))
    np.savez(data / "pickled.npz", frames=np.array([Payload(tmp_path / "UNPICKLED")], dtype=object))
    for stem in ("good", "billion", "terabytes", "inf", "pickled"):
        (data / f"{stem}.txt").write_text("a clip")
    config = load_config(overrides=[f'data.concepts=[{{"path": "{data}"}}]', f"cache_dir={tmp_path / 'cache'}",
                                    "data.frame_buckets=[9]", "data.resolution=32", "data.aspect_ratios=[1.0]"])
    loader = WanBaseDataLoader(config)
    loader.scan()
    report = loader.report()
    assert "clip items" in report and "skipped files: 4" in report, report
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for name, reason in [("billion.npz", "but the archive stores"), ("terabytes.npz", "more than the 16 GiB"),
                         ("inf.npz", "'fps' entry"), ("pickled.npz", "pickled Python objects")]:
        assert any(name in line and reason in line for line in warned.splitlines()), (name, warned)
    assert not (tmp_path / "UNPICKLED").exists()
