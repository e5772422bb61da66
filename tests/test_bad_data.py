"""Bad data never crashes a run (issue 14, section 3): captions in other encodings or with a byte-order mark, jsonl
lines that are not objects, .npz archives whose frames are not the first array, small clips under no_upscale,
element images of undeclared elements, short clips, and warnings once per run."""
import json
import logging

import numpy as np
import pytest
from PIL import Image

from modules.dataLoader.concept_scan import scan_concepts
from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
from modules.util.config.DataConfig import ConceptConfig, DataConfig
from modules.util.video_io import probe_media, read_frames
from modules.util.video_frames import write_video


def frames(count: int, height: int = 32, width: int = 32) -> np.ndarray:
    video = np.zeros((count, height, width, 3), np.uint8)
    for index in range(count):
        video[index, :, : (index + 1) * width // (count + 1)] = (200, 40, 40)
    return video


def image(path, height: int = 32, width: int = 32):
    Image.fromarray(frames(1, height, width)[0]).save(path)
    return path


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# --- captions ---------------------------------------------------------------------------------------------------

def test_a_caption_that_is_not_utf8_is_read_with_a_warning_naming_the_file(tmp_path, caplog):
    image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait, a cup on a table")      # Latin-1, as old tools write
    with caplog.at_level(logging.WARNING):
        result = scan_concepts([ConceptConfig(path=str(tmp_path))])
    assert [r["caption"] for r in result.records] == ["café au lait, a cup on a table"]
    [warning] = warnings_about(caplog, "not UTF-8")
    assert str(tmp_path / "a.txt") in warning


def test_a_byte_order_mark_is_removed_and_llm_prefixes_go_for_every_dataset(tmp_path):
    image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("\ufeffThe video shows a red square".encode("utf-8"))
    plain = scan_concepts([ConceptConfig(path=str(tmp_path))])
    assert plain.records[0]["caption"] == "The video shows a red square"
    stripped = scan_concepts([ConceptConfig(path=str(tmp_path), remove_common_llm_caption_prefixes=True)])
    assert stripped.records[0]["caption"] == "A red square"
    manifest = tmp_path / "train.jsonl"                                           # a manifest with a BOM too
    manifest.write_bytes('\ufeff{"path": "a.png", "prompt": "In this video, a square"}\n'.encode("utf-8"))
    from_manifest = scan_concepts([ConceptConfig(path=str(manifest), remove_common_llm_caption_prefixes=True)])
    assert [r["caption"] for r in from_manifest.records] == ["A square"]


# --- jsonl ------------------------------------------------------------------------------------------------------

def test_jsonl_lines_that_are_not_objects_are_skipped_naming_manifest_and_line(tmp_path, caplog):
    image(tmp_path / "a.png")
    manifest = tmp_path / "train.jsonl"
    manifest.write_text('"x.npz"\n5\n[1, 2]\n{"path": "a.png", "prompt": "a square"}\n{"path": 7}\n'
                        '{"path": "a.png", "prompt": 3}\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        result = scan_concepts([ConceptConfig(path=str(manifest))])
    assert [r["caption"] for r in result.records] == ["a square"]
    assert [path for path, _ in result.skipped] == [f"{manifest}:{n}" for n in (1, 2, 3, 5, 6)]
    assert "not a JSON object but a str" in result.skipped[0][1]
    assert len(warnings_about(caplog, str(manifest))) == 5


# --- npz --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arrays, key", [
    ({"prompt": np.array("a square"), "video": frames(5)}, "video"),        # named, not first
    ({"meta": np.zeros(3), "clip": frames(5)}, "clip"),                     # found by its shape
    ({"arr_1": np.zeros(2), "arr_0": frames(5)}, "arr_0"),
])
def test_the_npz_frame_array_is_found_by_name_or_shape(tmp_path, arrays, key):
    path = tmp_path / "clip.npz"
    np.savez(path, **arrays)
    info = probe_media(path)
    assert (info.frame_count, info.height, info.width) == (5, 32, 32)
    assert np.array_equal(read_frames(path, [0, 4]), arrays[key][[0, 4]])


# --- no_upscale -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("width, height, ratios", [(160, 96, DataConfig().aspect_ratios), (96, 160, [16 / 9]),
                                                   (64, 64, [16 / 9]), (64, 64, DataConfig().aspect_ratios),
                                                   (300, 200, [16 / 9, 9 / 16])])
def test_no_upscale_keeps_the_source_aspect(width, height, ratios):
    buckets = ResolutionBucket.make_buckets(480, ratios, 16)
    bucket_h, bucket_w = ResolutionBucket.choose(width, height, buckets, 16, no_upscale=True)
    assert bucket_h <= height and bucket_w <= width                              # never enlarged
    assert abs(bucket_w - bucket_h * width / height) < 16                        # within one unit of its aspect
    assert abs(bucket_h - bucket_w * height / width) < 16


# --- E2V element images of undeclared elements ------------------------------------------------------------------

def test_undeclared_element_images_are_not_samples(tmp_path, caplog):
    from modules.dataLoader.e2v_scan import scan_e2v_dataset
    from modules.util.config.E2VConfig import load_e2v_dataset_configs
    from modules.util.demo_e2v import demo_e2v_config
    for stem in ("001", "002"):
        write_video(tmp_path / f"{stem}.mp4", frames(17), 16)
        (tmp_path / f"{stem}.txt").write_text("a square")
        image(tmp_path / f"{stem}_person.png")
        image(tmp_path / f"{stem}_face.png")                                     # no element declares _face.png
    image(tmp_path / "002_depth.jpg")
    [dataset] = load_e2v_dataset_configs(demo_e2v_config(tmp_path))
    from modules.dataLoader.concept_scan import ScanResult
    result = ScanResult()
    with caplog.at_level(logging.WARNING):
        scan_e2v_dataset(dataset, ConceptConfig(path=str(tmp_path)), result)
    assert [r["path"] for r in result.records] == [str(tmp_path / "001.mp4"), str(tmp_path / "002.mp4")]
    assert result.skipped == []
    [notice] = warnings_about(caplog, "no element declares")
    assert "_face.png (2)" in notice and "_depth.jpg (1)" in notice


# --- short clips and warnings once per run ----------------------------------------------------------------------

def loader_for(folder, buckets):
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.util.config.config_io import load_config
    config = load_config(overrides=[f"data.concepts=[{json.dumps({'path': str(folder)})}]",
                                    f"data.frame_buckets={buckets}", "data.resolution=32", "data.aspect_ratios=[1.0]",
                                    "data.dataloader_threads=0"])
    return WanBaseDataLoader(config)


def test_each_skipped_file_is_warned_once_per_run(tmp_path, caplog):
    write_video(tmp_path / "long.mp4", frames(9), 16)
    write_video(tmp_path / "short.mp4", frames(5), 16)
    for stem in ("long", "short"):
        (tmp_path / f"{stem}.txt").write_text("a square")
    loader = loader_for(tmp_path, [9])
    with caplog.at_level(logging.WARNING):
        loader.scan()
        loader.report()
        loader.report()
    [warning] = warnings_about(caplog, "short.mp4")
    assert "shorter than the smallest frame bucket (9)" in warning


def test_a_clip_shorter_than_every_video_bucket_is_a_still_only_when_1_is_a_bucket(tmp_path, caplog, capsys):
    write_video(tmp_path / "short.mp4", frames(5), 16)
    (tmp_path / "short.txt").write_text("a square")
    write_video(tmp_path / "long.mp4", frames(9), 16)
    (tmp_path / "long.txt").write_text("a square")
    loader = loader_for(tmp_path, [1, 9])
    with caplog.at_level(logging.WARNING):
        loader.scan()
        report = loader.report()
    assert "1 clip items, 1 image items" in report
    [notice] = warnings_about(caplog, "short.mp4")
    assert "shorter than the smallest video bucket (9)" in notice and "still image" in notice
    caplog.clear()
    loader = loader_for(tmp_path, [9])
    with caplog.at_level(logging.WARNING):
        loader.scan()
        report = loader.report()
    assert "1 clip items, 0 image items" in report and "skipped files: 1" in report
    assert len(warnings_about(caplog, "short.mp4")) == 1
