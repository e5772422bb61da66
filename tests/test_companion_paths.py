"""A concept's companion paths (control_path, mask_path, default_mask) are judged before any model loads: a typo'd or
impossible folder exits 2 naming the field and what is allowed, as does a control model whose clips have no control
at all (they would train with a blank control). Each test ran scripts/train.py to exit 0 (or a later error) before
the change: the run trained every clip without its control or mask."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.util.video_frames import write_video
from tests.script_loader import load_script

train_script = load_script("train")

FRAMES, SIZE = 9, 32


def _frames(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (FRAMES, SIZE, SIZE, 3), dtype=np.uint8)


def clips_with_controls(root: Path, count: int = 2, controls: str | None = "controls") -> Path:
    """`root/clips/clip_i.mp4` with captions, and (unless `controls` is None) `root/<controls>/clip_i.mp4`."""
    clips = root / "clips"
    clips.mkdir(parents=True)
    for i in range(count):
        write_video(clips / f"clip_{i}.mp4", _frames(i), 16)
        (clips / f"clip_{i}.txt").write_text("a square\n")
        if controls:
            (root / controls).mkdir(exist_ok=True)
            write_video(root / controls / f"clip_{i}.mp4", _frames(100 + i), 16)
    return clips



def run_train(tmp_path: Path, base: Path, concept: str, *values: str) -> int:
    argv = ["--config-value", f"model.base_model_name={base}", "--config-value", f"data.concepts=[{concept}]",
            "--config-value", f"workspace_dir={tmp_path / 'run'}", "--config-value", f"cache_dir={tmp_path / 'cache'}",
            "--config-value", f"output.destination={tmp_path / 'out.safetensors'}", "--config-value", "max_steps=1",
            "--config-value", f"data.frame_buckets=[{FRAMES}]", "--config-value", f"data.resolution={SIZE}",
            "--config-value", "data.dataloader_threads=0", "--config-value", "device=cpu",
            "--config-value", "train_dtype=FLOAT_32"]
    for value in values:
        argv += ["--config-value", value]
    return train_script.main(argv)


def test_a_typod_control_path_exits_2_naming_field_and_path(tiny_model, tmp_path, capsys, no_model_loads):
    clips = clips_with_controls(tmp_path)
    concept = f'{{"path": "{clips}", "control_path": "{tmp_path}/controlz"}}'
    code = run_train(tmp_path, tiny_model("wan2.1-vace"), concept)
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"data.concepts.0.control_path: '{tmp_path}/controlz' does not exist; allowed: an existing, readable " \
           f"folder" in error, error
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("path, why", [("/", "is the file system's root"), ("/proc/self", "is a system folder"),
                                       ("/dev/zero", "is not a regular file"), ("README", "is a file, not a folder"),
                                       ("CLIPS", "is the concept's own folder")])
@pytest.mark.parametrize("field", ["control_path", "mask_path"])
def test_a_companion_folder_that_cannot_be_one_is_refused(tiny_model, tmp_path, capsys, no_model_loads, field, path,
                                                          why):
    clips = clips_with_controls(tmp_path)
    (tmp_path / "README").write_text("not a folder")
    path = {"README": str(tmp_path / "README"), "CLIPS": str(clips)}.get(path, path)
    code = run_train(tmp_path, tiny_model("wan2.1-vace"), f'{{"path": "{clips}", "{field}": "{path}"}}')
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"data.concepts.0.{field}: {path!r} {why}" in error and "allowed: an existing, readable folder" in error, \
        error


@pytest.mark.parametrize("path, why", [("missing.png", "does not exist"), ("/dev/zero", "is not a regular file"),
                                       ("README", "is no image or video")])
def test_a_default_mask_that_is_no_mask_file_is_refused(tiny_model, tmp_path, capsys, no_model_loads, path, why):
    clips = clips_with_controls(tmp_path, controls=None)
    (tmp_path / "README").write_text("not a mask")
    path = str(tmp_path / path) if not path.startswith("/") else path
    code = run_train(tmp_path, tiny_model("wan2.1-t2v"), f'{{"path": "{clips}", "default_mask": "{path}"}}')
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"data.concepts.0.default_mask: {path!r} {why}" in error, error


@pytest.mark.parametrize("field, kind", [("control_path", "control"), ("mask_path", "mask")])
def test_a_folder_holding_nothing_named_as_the_clips_exits_2(tiny_model, tmp_path, capsys, no_model_loads, field,
                                                             kind):
    clips = clips_with_controls(tmp_path, controls="controls")
    other = tmp_path / "other"
    other.mkdir()
    Image.fromarray(np.zeros((SIZE, SIZE, 3), np.uint8)).save(other / "unrelated.png")
    code = run_train(tmp_path, tiny_model("wan2.1-vace"), f'{{"path": "{clips}", "{field}": "{other}"}}')
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"data.concepts.0.{field}: {str(other)!r} holds no {kind} named as any of the concept's 2 clips" in error, \
        error


@pytest.mark.parametrize("variant", ["wan2.1-vace", "wan2.1-fun-control"])
def test_a_control_model_with_no_control_on_any_clip_is_named(tiny_model, tmp_path, capsys, no_model_loads, variant):
    clips = clips_with_controls(tmp_path, controls=None)
    code = run_train(tmp_path, tiny_model(variant), f'{{"path": "{clips}"}}')
    error = capsys.readouterr().err
    assert code == 2, error
    assert "is a control model, but no clip of" in error and str(clips) in error and "_control" in error, error
    assert "data.control.derive" in error, error


def test_the_data_report_counts_clips_without_a_control(tiny_model, tmp_path):
    """Some clips without a control train with a zero control (docs/vace.md): the report says how many."""
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.util.config.config_io import load_config
    from modules.util.enum.WanVariant import WanVariant
    clips = clips_with_controls(tmp_path, count=3, controls=None)
    write_video(clips / "clip_0_control.mp4", _frames(50), 16)
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-vace')}",
                                    f'data.concepts=[{{"path": "{clips}"}}]', f"data.frame_buckets=[{FRAMES}]",
                                    f"data.resolution={SIZE}", "data.dataloader_threads=0"])
    loader = WanBaseDataLoader(config, WanVariant.VACE)
    loader.scan()
    assert loader.companion_problems() == []
    assert "controls: 1 of 3 files have their own; the others train with a zero control" in loader.report()


def test_a_manifest_control_that_is_no_control_skips_its_line_and_is_counted(tmp_path):
    """A manifest line's control is media: `/`, a device, a text file or a folder without frames skips that line
    with its reason (before: accepted, read while caching or trained as a control)."""
    import json
    from modules.dataLoader.concept_scan import scan_concepts
    from modules.util.config.DataConfig import ConceptConfig
    clips = clips_with_controls(tmp_path, count=5)
    (tmp_path / "notes.txt").write_text("not a control")
    (tmp_path / "empty").mkdir()
    controls = ["/", "/dev/zero", str(tmp_path / "notes.txt"), str(tmp_path / "empty"),
                str(tmp_path / "controls" / "clip_4.mp4")]
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps({"path": str(clips / f"clip_{i}.mp4"), "caption": "x",
                                            "control_path": control}) + "\n" for i, control in enumerate(controls)))
    result = scan_concepts([ConceptConfig(path=str(manifest))])
    reasons = dict(result.skipped)
    assert [Path(r["path"]).name for r in result.records] == ["clip_4.mp4"]
    assert reasons[str(clips / "clip_0.mp4")].startswith("its control / is a folder without frames")
    assert "is not a regular file" in reasons[str(clips / "clip_1.mp4")]
    assert "is no video or image" in reasons[str(clips / "clip_2.mp4")]
    assert "is a folder without frames" in reasons[str(clips / "clip_3.mp4")]
