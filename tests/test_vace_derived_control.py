"""`data.control.derive` (canny / gray from the clip's own frames, at cache time) and `data.control.loss_region`
(mask: the control mask weighs the loss; all: it only conditions)."""
import numpy as np
import pytest
import torch
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.model.control_derive import derive_control
from modules.model.vace_condition import model_encoder, vace_context
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.config_io import load_config
from modules.util.demo_squares import square_clip
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import frames_to_tensor, write_video
from modules.util.video_io import read_frames

FRAMES, SIZE = 9, 32


@pytest.fixture(scope="module")
def vace_model(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-vace"))))


def _folder(tmp_path, mask: bool = False, control: bool = False):
    folder = tmp_path / "data"
    folder.mkdir()
    # at the bucket's size: the derived control is made from the decoded frames as they are
    write_video(folder / "clip.mp4", square_clip((250, 250, 250), "right", FRAMES, SIZE, offset=3), 16)
    (folder / "clip.txt").write_text("a red square\n")
    if mask:
        pixels = np.zeros((SIZE, SIZE, 3), np.uint8)
        pixels[:, SIZE // 2:] = 255
        Image.fromarray(pixels).save(folder / "clip_mask.png")
    if control:
        (folder / "clip_control").mkdir()
        for index in range(FRAMES):
            Image.fromarray(np.full((SIZE, SIZE, 3), 255, np.uint8)).save(folder / "clip_control" / f"{index:03d}.png")
    return folder


def _batch(tmp_path, folder, model, *overrides):
    config = load_config(overrides=[
        f"model.base_model_name={model.source}", f"cache_dir={tmp_path / 'cache'}", "device=cpu",
        f'data.concepts=[{{"path": "{folder}"}}]', "data.frame_buckets=[9]", "data.resolution=32",
        "data.aspect_ratios=[1.0]", "data.dataloader_threads=0", *overrides])
    loader = WanBaseDataLoader(config, WanVariant.VACE)
    loader.scan()
    loader.attach_model(model, torch.device("cpu"))
    loader.cache()
    return next(loader.batches(0)), loader


@pytest.mark.parametrize("kind", ["canny", "gray"])
def test_a_derived_control_is_the_context_of_the_clips_own_frames_so_derived(kind, tmp_path, vace_model):
    folder = _folder(tmp_path)
    batch, _ = _batch(tmp_path, folder, vace_model, f"data.control.derive={kind}")
    frames = read_frames(str(folder / "clip.mp4"), list(range(FRAMES)))
    control = derive_control(frames, kind)
    assert control.shape == (FRAMES, SIZE, SIZE, 3) and control.any()
    with torch.no_grad():
        expected = vace_context(model_encoder(vace_model), frames_to_tensor(control), None)
        underived = vace_context(model_encoder(vace_model), None, None, num_frames=FRAMES, height=SIZE, width=SIZE)
    torch.testing.assert_close(batch["vace_context"][0], expected, atol=1e-6, rtol=0)
    assert (batch["vace_context"][0] - underived).abs().max() > 0.1


def test_a_clips_own_control_wins_over_the_derived_one(tmp_path, vace_model):
    folder = _folder(tmp_path, control=True)
    derived, _ = _batch(tmp_path, folder, vace_model, "data.control.derive=canny")
    with torch.no_grad():
        white = vace_context(model_encoder(vace_model), torch.ones(3, FRAMES, SIZE, SIZE), None)
    torch.testing.assert_close(derived["vace_context"][0], white, atol=1e-6, rtol=0)


def test_loss_region_all_leaves_the_mask_to_the_condition(tmp_path, vace_model):
    folder = _folder(tmp_path, mask=True)
    weighted, _ = _batch(tmp_path, folder, vace_model)
    assert weighted["mask_weight"][0, 0, :, :, :2].eq(0).all() and weighted["mask_weight"][0, 0, :, :, 2:].eq(1).all()
    unweighted, _ = _batch(tmp_path, folder, vace_model, "data.control.loss_region=all")
    assert "mask_weight" not in unweighted
    # the mask still conditions the model: the same context either way
    torch.testing.assert_close(unweighted["vace_context"], weighted["vace_context"])


def test_the_derived_controls_take_the_official_annotators_form():
    """VACE's GrayAnnotator converts RGB frames with OpenCV's BGR weights (red counts 0.114); its CannyAnnotator
    draws white edges on black at thresholds 100 / 200."""
    frames = np.zeros((1, 16, 16, 3), np.uint8)
    frames[0, 4:12, 4:12] = (255, 0, 0)
    grey = derive_control(frames, "gray")
    assert grey.shape == (1, 16, 16, 3) and grey[0, 8, 8].tolist() == [29, 29, 29] and grey[0, 0, 0].tolist() == [0] * 3
    edges = derive_control(frames, "canny")[0, ..., 0]
    assert set(np.unique(edges)) == {0, 255} and edges[8, 8] == 0 and edges[:, 3:5].any() and not edges[:2].any()
