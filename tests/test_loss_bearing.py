"""A run must never train nothing and exit 0. Animate / Animate-2 with `animate.continuation_frames` not shorter than
every frame bucket exits 2 before any model loads; clips cut no longer than the continuation frames are skipped and
counted by name; a run whose every step has no loss-bearing element stops before its final save. Before the change
each of these trained with `loss=0.0000` on every step, exit 0, and saved a LoRA as if trained."""
import numpy as np
import pytest
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.trainer.errors import TrainingError
from modules.util.config.config_io import load_config
from modules.util.demo_animate import make_animate_2_dataset, make_animate_dataset
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import write_video
from tests.learning import train
from tests.script_loader import load_script

train_script = load_script("train")


@pytest.mark.parametrize("variant, make", [("wan2.2-animate-2", make_animate_2_dataset),
                                           ("wan2.2-animate", make_animate_dataset)])
def test_continuation_frames_no_shorter_than_every_bucket_exit_2_before_loading(tiny_model, tmp_path, capsys,
                                                                               no_model_loads, variant, make):
    data = make(tmp_path / "data", clips_per_class=1, frames=5, size=32)
    values = [f"model.base_model_name={tiny_model(variant)}", "model_type=WAN_2_2",
              f'data.concepts=[{{"path": "{data}"}}]', f"workspace_dir={tmp_path / 'run'}",
              f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu", "train_dtype=FLOAT_32",
              "max_steps=2", "animate.continuation_frames=5", "data.frame_buckets=[5]"]
    code = train_script.main([arg for value in values for arg in ("--config-value", value)])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "animate.continuation_frames: 5 frames condition each clip and carry no loss, but data.frame_buckets " \
           "[5] cuts no clip longer than 5 frames" in error, error
    assert not (tmp_path / "out.safetensors").exists()


def test_clips_no_longer_than_the_continuation_frames_are_skipped_and_counted(tmp_path):
    short = make_animate_2_dataset(tmp_path / "short", clips_per_class=1, frames=5, size=32)
    long = make_animate_2_dataset(tmp_path / "long", clips_per_class=1, frames=9, size=32)
    config = load_config(overrides=[f'data.concepts=[{{"path": "{short}"}}, {{"path": "{long}"}}]',
                                    "data.frame_buckets=[5, 9]", "data.resolution=32", "data.dataloader_threads=0",
                                    "animate.continuation_frames=5"])
    loader = WanBaseDataLoader(config, WanVariant.ANIMATE_2_14B)
    loader.scan()
    stats = loader.statistics()
    clips = {str(p) for p in short.glob("*.mp4") if not p.stem.endswith("_driving")}
    skipped = {path: reason for path, reason in stats.skipped}
    assert clips and clips <= set(skipped), stats.skipped
    assert all("no longer than animate.continuation_frames (5): no frame of it would carry loss" in skipped[c]
               for c in clips)
    assert set(stats.buckets) == {(9, 32, 32)} and all(str(long) in p for p in stats.paths)


def test_a_run_whose_every_step_carries_no_loss_stops_without_saving(tiny_model, tmp_path, caplog):
    """Clips 64 x 32 whose mask is white only in its left 8 columns train in the 32 x 32 bucket, centre-cropped: the
    crop cuts the white away, so every step's loss mask is 0 everywhere (the scan cannot know: the mask file is not
    black) and each step's loss reads 0."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        write_video(data / f"clip_{i}.mp4", np.full((9, 32, 64, 3), 60 * (i + 1), np.uint8), 16)
        (data / f"clip_{i}.txt").write_text("a grey field\n")
    mask = np.zeros((32, 64, 3), np.uint8)
    mask[:, :8] = 255
    Image.fromarray(mask).save(tmp_path / "edge_mask.png")
    with pytest.raises(TrainingError, match=r"no step of this run trained anything: in each of its 2 steps every "
                                            r"element of the loss was masked out .* no model is saved"):
        train(tmp_path, tiny_model("wan2.1-t2v"), data, steps=2, overrides=[
            f"data.concepts.0.default_mask={tmp_path / 'edge_mask.png'}", "batch_size=1"])
    assert not (tmp_path / "out.safetensors").exists()
    assert any("step 1: no element of its loss carries weight" in r.getMessage() for r in caplog.records)


def test_every_concept_weighted_0_exits_2_before_loading(tiny_model, squares_dataset, tmp_path, capsys,
                                                        no_model_loads):
    values = [f"model.base_model_name={tiny_model('wan2.1-t2v')}", f'data.concepts=[{{"path": "{squares_dataset}", '
              f'"loss_weight": 0}}]', f"workspace_dir={tmp_path / 'run'}",
              f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu", "max_steps=1"]
    code = train_script.main([arg for value in values for arg in ("--config-value", value)])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "data.concepts.0.loss_weight: every training concept has loss_weight 0" in error, error


def test_a_run_with_loss_bearing_steps_saves(tiny_model, squares_dataset, tmp_path):
    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, steps=2)
    assert trainer.loss_bearing_steps == 2 and trainer.empty_steps == 0
    assert (tmp_path / "out.safetensors").is_file()
