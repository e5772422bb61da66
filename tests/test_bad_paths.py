"""Paths that are no regular file (/dev/null, /dev/zero, a FIFO, a link to a device) are named as such before any
model loads, all at once; such a file in a concept folder is skipped with a warning and counted; a musubi-tuner
video_directory reads its folders of frames; seed 004's command without a model names the flag that gives one.
Each test failed before the change (see the comments)."""
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.dataLoader.concept_scan import scan_concepts
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.DataConfig import ConceptConfig
from modules.trainer.prepare import prepare_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402


def image(path: Path, colour=(200, 40, 40), height: int = 32, width: int = 64) -> None:
    Image.fromarray(np.full((height, width, 3), colour, np.uint8)).save(path)


def config_with(tiny_model, tmp_path: Path, *values: str):
    clips = tmp_path / "clips"
    clips.mkdir()
    image(clips / "a.png")
    return load_config(overrides=[
        f"model.base_model_name={tiny_model('wan2.1-t2v')}", f'data.concepts=[{{"path": "{clips}"}}]',
        f"workspace_dir={tmp_path / 'run'}", f"output.destination={tmp_path / 'o.safetensors'}", *values])


def test_device_and_fifo_paths_are_refused_as_not_regular_files_all_at_once(tiny_model, tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    config = config_with(tiny_model, tmp_path, f"model.image_encoder.path={ROOT / 'README.md'}",
                         "model.vae.path=/dev/null", f"model.transformer.path={fifo}", "sampling.samples_file=/dev/zero",
                         "lora.init_from=/dev/zero")
    # before: a NotADirectoryError traceback from recognise.find_parts; alone, /dev/zero "does not exist"
    with pytest.raises(ConfigError) as error:
        prepare_config(config)
    problems = error.value.problems
    for field, path in [("model.transformer.path", fifo), ("model.vae.path", "/dev/null"),
                        ("sampling.samples_file", "/dev/zero"), ("lora.init_from", "/dev/zero")]:
        assert f"{field}: {str(path)!r} is not a regular file (a device, FIFO or socket" in " | ".join(problems), \
            problems
    assert len(problems) == 4, problems


def test_a_part_path_that_is_no_model_file_is_named_by_its_field(tiny_model, tmp_path):
    config = config_with(tiny_model, tmp_path, f"model.image_encoder.path={ROOT / 'README.md'}")
    # before: blamed on model.base_model_name
    with pytest.raises(ConfigError, match=r"model.image_encoder.path: .*README.md: not a weight file"):
        prepare_config(config)


def test_a_fifo_or_a_link_to_a_device_named_as_a_clip_is_skipped_and_counted(tmp_path, caplog):
    image(tmp_path / "good.png")
    (tmp_path / "good.txt").write_text("a square")
    os.mkfifo(tmp_path / "pipe.mp4")
    os.symlink("/dev/zero", tmp_path / "zeros.mp4")
    for name in ("pipe", "zeros"):
        (tmp_path / f"{name}.txt").write_text("a caption")
    with caplog.at_level(logging.WARNING):
        result = scan_concepts([ConceptConfig(path=str(tmp_path))])
    # before: both dropped without a word ("skipped files: 0")
    assert [r["path"] for r in result.records] == [str(tmp_path / "good.png")]
    assert sorted(Path(path).name for path, _ in result.skipped) == ["pipe.mp4", "zeros.mp4"]
    assert all(reason.startswith("not a regular file") for _, reason in result.skipped)
    assert len([r for r in caplog.records if "not a regular file" in r.getMessage()]) == 2


def test_a_musubi_video_directory_reads_its_folders_of_frames(tmp_path, monkeypatch):
    """musubi-tuner's video_path may name a folder of images (one clip): a video_directory holding such folders is
    read the same way. Before: "no usable training item" and no reason."""
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.dataLoader.pipeline.LoadVideo import LoadVideo
    from modules.dataLoader.pipeline.Pipeline import Pipeline
    monkeypatch.chdir(tmp_path)
    clip = tmp_path / "videos" / "clip_a"
    clip.mkdir(parents=True)
    for index in range(9):
        image(clip / f"{index:04d}.png", colour=(20 * index, 0, 0))
    (tmp_path / "videos" / "clip_a.txt").write_text("a fading square")
    (tmp_path / "videos" / "notes").mkdir()  # a folder without images is no clip
    (tmp_path / "dataset.toml").write_text('[general]\nresolution = [64, 32]\n\n[[datasets]]\n'
                                           'video_directory = "videos"\ntarget_frames = [9]\n')
    config = load_config(overrides=["data.dataset_config=dataset.toml", "data.dataloader_threads=0"])
    loader = WanBaseDataLoader(config)
    loader.scan()
    assert loader.statistics().buckets == {(9, 32, 64): 1}
    items = Pipeline(loader._item_modules()[:3] + [LoadVideo()], config.seed, outputs=["frames", "caption"])
    items.start_epoch(0)
    [row] = [items.get_item(i) for i in range(len(items))]
    assert row["caption"] == "a fading square"
    reds = [int(v) for v in np.asarray(row["frames"])[..., 0].reshape(9, -1).mean(1).round()]
    assert reds == [20 * i for i in range(9)]


def test_seed_004_command_without_a_model_names_the_model_name_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps({"video_path": "a.mp4", "prompt": "x"}) + "\n")
    code = train_script.main(["--manifest", "train.jsonl", "--output_dir", "outputs/smoke_test", "--max_steps", "50",
                              "--batch_size", "1", "--gradient_accumulation_steps", "4"])
    error = capsys.readouterr().err
    assert code == 2
    # before: "model.base_model_name: required, but empty (a diffusers folder, or a hub id)", no flag named
    assert "model.base_model_name: required, but empty" in error and "--model_name" in error, error
