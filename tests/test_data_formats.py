"""Issue 14 section 5 and issue 15 section 5: the data formats of docs/data.md. Seed 004's layout (a train.jsonl
manifest of .npz clips) trains through run-cmd.sh from the user's own folder with relative paths; musubi-tuner's and
diffusion-pipe's dataset TOML and musubi-tuner's metadata.jsonl read into concepts with the peers' meaning; keys we
cannot honour are refused naming the file, the key and what is supported."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.dataLoader.concept_scan import scan_concepts
from modules.dataLoader.pipeline.FrameWindow import FrameWindow
from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.util.config.config_io import ConfigError, load_config, save_config
from modules.util.config.DataConfig import ConceptConfig
from modules.util.demo_assets import COLOURS, square_clip
from modules.util.video_frames import write_video

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402


def items(config) -> list[dict]:
    """(path name, frame count, first source frame, bucket) of every item of epoch 0; probing only, no model."""
    loader = WanBaseDataLoader(config)
    loader.scan()
    pipeline = Pipeline(loader._item_modules(), config.seed,
                        outputs=["path", "frame_bucket", "frame_indices", "resolution_bucket"])
    pipeline.start_epoch(0)
    rows = [pipeline.get_item(i) for i in range(len(pipeline))]
    return sorted((Path(r["path"]).name, r["frame_bucket"], r["frame_indices"][0], r["resolution_bucket"])
                  for r in rows)


def video(path: Path, frames: int, height: int = 16, width: int = 16, caption: str | None = "a clip",
          caption_extension: str = ".txt") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_video(path, square_clip(COLOURS["red"], "left", frames, max(height, width), 0)[:, :height, :width], 16)
    if caption is not None:
        path.with_suffix(caption_extension).write_text(caption)
    return path


# --------------------------------------------------------------------------------------- seed 004 and the user's cwd

def fake_install(tmp_path: Path) -> Path:
    """A project folder holding the real run-cmd.sh and scripts/; install.sh is a stand-in that installs nothing
    (the real one would run pip when the requirement files differ from what this venv was built from: not what is
    tested here), and .venv/bin/python runs this interpreter."""
    project = tmp_path / "project"
    (project / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "run-cmd.sh", project / "run-cmd.sh")
    (project / "scripts").symlink_to(ROOT / "scripts")
    (project / "install.sh").write_text("#!/bin/sh\nexit 0\n")
    (project / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for name in ("run-cmd.sh", "install.sh", ".venv/bin/python"):
        (project / name).chmod(0o755)
    return project


def test_seed_004_layout_trains_through_run_cmd_from_the_users_folder(tiny_model, tmp_path):
    """Seed 004 at a tiny size: data/processed/train.jsonl lists .npz clips (uint8 (T, H, W, 3) under 'frames', no
    fps) with their prompts; the manifest's paths are written from the user's project folder, as a preprocessing
    script run there writes them. The user runs run-cmd.sh from that folder with a relative --config-path, and the
    config's relative paths (concept, workspace, output) resolve there, not in the trainer's folder."""
    project = fake_install(tmp_path)
    user = tmp_path / "user-project"
    clips = user / "data" / "processed" / "clips"
    clips.mkdir(parents=True)
    lines = []
    for i, (activity, colour) in enumerate([("clapping", "red"), ("sitting", "green"), ("walking", "blue")]):
        # seed 004 writes 81 frames of 480x832; 9 frames of 32x56 keep its aspect at a size the tiny model trains fast
        frames = square_clip(COLOURS[colour], "left", 9, 56, i)[:, 12:44]
        np.savez(clips / f"{i:05d}.npz", frames=frames)
        lines.append(json.dumps({"path": f"data/processed/clips/{i:05d}.npz",
                                 "prompt": f"A realistic video showing a person {activity}"}))
    (user / "data" / "processed" / "train.jsonl").write_text("\n".join(lines) + "\n")
    (user / "configs").mkdir()
    (user / "configs" / "smoke_test.json").write_text(json.dumps({
        "model": {"base_model_name": str(tiny_model("wan2.1-t2v"))},
        "data": {"concepts": [{"path": "data/processed/train.jsonl"}],
                 # the tiny sizes of seed 004's 81-frame 832x480 clips (16:9 buckets, as the seed's aspect)
                 "frame_buckets": [9], "resolution": 32, "dataloader_threads": 0},
        "workspace_dir": "outputs/smoke_test/workspace", "cache_dir": "outputs/cache",
        "output": {"destination": "outputs/smoke_test/lora.safetensors"},
        "device": "cpu", "train_dtype": "FLOAT_32", "max_steps": 2, "batch_size": 1, "tensorboard": False}))
    result = subprocess.run([str(project / "run-cmd.sh"), "train", "--config-path", "configs/smoke_test.json"],
                            cwd=user, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (user / "outputs" / "smoke_test" / "lora.safetensors").is_file()
    assert "concept data/processed/train.jsonl: 3 clip items" in result.stdout
    assert "bucket 9 frames x 48x32: 3" in result.stdout  # 56:32 picks the 16:9 bucket (48x32 at area 32^2)
    assert not (project / "outputs").exists() and not (project / "data").exists()


def test_run_cmd_called_through_a_link_finds_the_project(tmp_path):
    project = fake_install(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "wan").symlink_to(Path("..") / "project" / "run-cmd.sh")
    result = subprocess.run([str(tmp_path / "bin" / "wan")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "scripts:" in result.stderr and " train " in result.stderr, result.stderr


def test_shipped_demo_preset_works_from_another_folder(tmp_path, monkeypatch, demo_model):
    """The demo preset's project-relative paths (workspace/demo/...) resolve against the directory the command
    runs from, like every relative path in a config: from another folder the demo assets are made there. (The
    session's demo model stands in for the one the first use makes: the model is found there, not made again.)"""
    from modules.trainer.prepare import prepare_config
    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo_model, tmp_path / "workspace" / "demo" / "tiny-wan2.1-t2v")
    config = load_config(preset_path=str(ROOT / "training_presets" / "#demo tiny CPU.json"))
    prepare_config(config)
    assert Path(config.model.base_model_name).resolve() == (tmp_path / "workspace" / "demo" / "tiny-wan2.1-t2v")
    assert len(list((tmp_path / "workspace" / "demo" / "squares").glob("*.mp4"))) == 12   # 2 shades a caption
    assert (tmp_path / "workspace" / "demo" / "samples.json").is_file()


def test_manifest_paths_beside_the_manifest_win_over_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    video(tmp_path / "sets" / "clips" / "a.mp4", 5)
    video(tmp_path / "clips" / "b.mp4", 5)           # only reachable from the current folder
    video(tmp_path / "clips" / "a.mp4", 5)           # shadowed by the one beside the manifest
    manifest = tmp_path / "sets" / "train.jsonl"
    manifest.write_text(json.dumps({"video_path": "clips/a.mp4", "caption": "beside"}) + "\n"
                        + json.dumps({"video_path": "clips/b.mp4", "caption": "from cwd"}) + "\n"
                        + json.dumps({"video_path": "clips/c.mp4", "caption": "nowhere"}) + "\n")
    result = scan_concepts([ConceptConfig(path=str(manifest))])
    assert [(Path(r["path"]).resolve(), r["caption"]) for r in result.records] == [
        ((tmp_path / "sets" / "clips" / "a.mp4").resolve(), "beside"), ((tmp_path / "clips" / "b.mp4").resolve(),
                                                                        "from cwd")]
    assert [Path(p).name for p, _ in result.skipped] == ["c.mp4"]


# --------------------------------------------------------------------------------------- musubi-tuner

MUSUBI_40_FRAMES = {
    # musubi-tuner's docs/dataset_config.md draws each extraction of a 40-frame video: (count, start) per item
    ("head", ()): [(1, 0), (13, 0), (25, 0)],
    ("chunk", ()): [(13, 0), (13, 13), (13, 26), (25, 0)],
    ("slide", (("frame_stride", 10),)): [(1, 0), (1, 10), (1, 20), (1, 30), (13, 0), (13, 10), (13, 20), (25, 0),
                                        (25, 10)],
    ("uniform", (("frame_sample", 4),)): [(1, 0), (1, 13), (1, 26), (1, 39), (13, 0), (13, 9), (13, 18), (13, 27),
                                          (25, 0), (25, 5), (25, 10), (25, 15)],
}


@pytest.mark.parametrize("mode, extra", list(MUSUBI_40_FRAMES))
def test_musubi_frame_extraction_matches_its_documented_diagrams(mode, extra, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "videos").mkdir()
    targets = "[13, 25]" if mode == "chunk" else "[1, 13, 25]"
    lines = [f"[[datasets]]", 'video_directory = "videos"', f"target_frames = {targets}",
             f'frame_extraction = "{mode}"'] + [f"{k} = {v}" for k, v in extra]
    (tmp_path / "d.toml").write_text("\n".join(lines) + "\n")
    config = load_config(overrides=["data.dataset_config=d.toml"])
    concept = config.data.concepts[0]
    window = FrameWindow(config.data.frame_buckets, 16)
    assert window.windows(40, concept) == MUSUBI_40_FRAMES[(mode, extra)]


def test_musubi_full_extraction_matches_its_documented_diagram(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "videos").mkdir()
    (tmp_path / "d.toml").write_text('[[datasets]]\nvideo_directory = "videos"\nframe_extraction = "full"\n'
                                     'max_frames = 31\n')
    concept = load_config(overrides=["data.dataset_config=d.toml"]).data.concepts[0]
    window = FrameWindow([1, 5], 16)
    # the diagram shows 17, 25 and "31" frames; 31 is not 4k+1, and musubi-tuner's code rounds min(35, 31) down to
    # 4k+1 = 29, as here
    assert [window.windows(n, concept) for n in (20, 25, 35)] == [[(17, 0)], [(25, 0)], [(29, 0)]]


def test_musubi_dataset_config_trains_its_datasets_with_its_settings(tmp_path, monkeypatch, caplog):
    """The documented video + image layout: [general] settings, a video folder with .caption sidecars and
    target_frames, an image folder repeated twice, a metadata.jsonl dataset with video_path / caption; the items
    are what musubi-tuner makes (one per target count the clip holds) at its one bucket of 64x32."""
    monkeypatch.chdir(tmp_path)
    video(tmp_path / "videos" / "long.mp4", 30, 32, 64, "long", ".caption")
    video(tmp_path / "videos" / "short.mp4", 10, 32, 64, "short", ".caption")
    video(tmp_path / "videos" / "nocaption.mp4", 10, 32, 64, None)
    video(tmp_path / "jsonl" / "listed.mp4", 14, 32, 64, None)
    (tmp_path / "images").mkdir()
    Image.new("RGB", (64, 32), (40, 80, 230)).save(tmp_path / "images" / "still.png")
    (tmp_path / "images" / "still.txt").write_text("a still")
    # musubi-tuner reads video_path as written, i.e. from the current folder
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"video_path": "jsonl/listed.mp4", "caption": "listed"}))
    (tmp_path / "dataset.toml").write_text("""
[general]
resolution = [64, 32]
caption_extension = ".caption"
batch_size = 2
enable_bucket = false
bucket_no_upscale = false

[[datasets]]
video_directory = "videos"
cache_directory = "cache/videos"
target_frames = [1, 5, 9]
frame_extraction = "head"

[[datasets]]
image_directory = "images"
caption_extension = ".txt"
cache_directory = "cache/images"
num_repeats = 2

[[datasets]]
video_jsonl_file = "metadata.jsonl"
cache_directory = "cache/jsonl"
target_frames = [13]
""")
    config = load_config(overrides=["data.dataset_config=dataset.toml", "data.dataloader_threads=0"])
    assert config.batch_size == 2 and config.data.frame_buckets == [1, 5, 9, 13]
    assert [(c.path, c.repeats, c.caption_extension) for c in config.data.concepts] == [
        ("videos", 1, ".caption"), ("images", 2, ".txt"), ("metadata.jsonl", 1, ".txt")]
    assert all(c.fps == "source" for c in config.data.concepts)  # no source_fps: every frame as stored
    assert items(config) == sorted(
        [("long.mp4", f, 0, (32, 64)) for f in (1, 5, 9)] + [("short.mp4", f, 0, (32, 64)) for f in (1, 5, 9)]
        + [("still.png", 1, 0, (32, 64))] * 2 + [("listed.mp4", 13, 0, (32, 64))])
    assert "trains as a still" not in caplog.text  # the 1-frame items are what target_frames asks for


def test_musubi_resolution_with_buckets_keeps_its_area_and_aspects(tmp_path, monkeypatch):
    from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v").mkdir()
    for enable in ("false", "true"):
        (tmp_path / "d.toml").write_text(f'[general]\nresolution = [960, 544]\nenable_bucket = {enable}\n'
                                         f'bucket_no_upscale = true\n[[datasets]]\nvideo_directory = "v"\n')
        data = load_config(overrides=["data.dataset_config=d.toml"]).data
        buckets = ResolutionBucket.make_buckets(data.resolution, data.aspect_ratios, 16)
        assert data.no_upscale is True
        if enable == "false":
            assert buckets == [(544, 960)]  # musubi-tuner's single bucket, exactly
        else:
            assert (544, 960) in buckets and (960, 544) in buckets and len(buckets) > 20
            assert all(abs(h * w / (960 * 544) - 1) < 0.08 for h, w in buckets)


def test_musubi_keys_we_cannot_honour_are_refused_with_the_file_key_and_choices(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v").mkdir()
    (tmp_path / "control.jsonl").write_text(json.dumps({"video_path": "a.mp4", "control_path_0": "c.png",
                                                        "caption": "x"}) + "\n")
    (tmp_path / "bad.toml").write_text("""
[general]
resolution = [960, 544]
[[datasets]]
video_directory = "v"
control_directory = "c"
fp_latent_window_size = 9
frame_extraction = "sideways"
[[datasets]]
video_jsonl_file = "control.jsonl"
resolution = [512, 512]
[[datasets]]
image_directory = "missing"
""")
    assert train_script.main(["--dataset-config", "bad.toml"]) == 2
    err = capsys.readouterr().err
    for expected in ("invalid configuration in bad.toml",
                     "datasets.0.control_directory: 'c' is not a folder",
                     "datasets.0.fp_latent_window_size: not supported here: a FramePack setting",
                     "supported keys in [[datasets]]: batch_size, bucket_no_upscale, cache_directory",
                     "datasets.0.frame_extraction: 'sideways' is not one of head, chunk, slide, uniform, full",
                     "datasets.1.video_jsonl_file: its lines hold 'control_path_0'",
                     "datasets.1.resolution: [512, 512] differs from general.resolution ([960, 544])",
                     "datasets.2.image_directory: 'missing' is not a folder"):
        assert expected in err, err


# --------------------------------------------------------------------------------------- diffusion-pipe

def test_diffusion_pipe_dataset_config_trains_its_directories_with_its_buckets(tmp_path, monkeypatch):
    """examples/dataset.toml's layout: resolutions, aspect buckets from min_ar / max_ar / num_ar_buckets, frame
    buckets, and [[directory]] tables with num_repeats; a video goes to the longest frame bucket it holds at the
    model's 16 fps (a 24 fps clip of 45 frames holds 30 frames at 16 fps: bucket 17 of [1, 17, 33])."""
    monkeypatch.chdir(tmp_path)
    video(tmp_path / "clips" / "wide.mp4", 40, 32, 64)
    write_video(tmp_path / "clips" / "fast.mp4", square_clip(COLOURS["red"], "left", 45, 32, 0), 24)
    (tmp_path / "clips" / "fast.txt").write_text("fast")
    video(tmp_path / "more" / "uncaptioned.mp4", 20, 32, 32, None)
    (tmp_path / "dataset.toml").write_text("""
resolutions = [32]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 3
frame_buckets = [1, 17, 33]

[[directory]]
path = 'clips'
num_repeats = 3

[[directory]]
path = 'more'
skip_empty_caption = false
""")
    config = load_config(overrides=["data.dataset_config=dataset.toml", "data.dataloader_threads=0"])
    data = config.data
    assert data.resolution == 32 and data.frame_buckets == [1, 17, 33]
    assert [round(r, 6) for r in data.aspect_ratios] == [2.0, 1.0, 0.5]
    assert [(c.repeats, c.caption_required, c.fps) for c in data.concepts] == [(3, True, "model"),
                                                                               (1, False, "model")]
    # the 2:1 bucket at area 32^2: width sqrt(1024 * 2) = 45.3 -> 48, height 1024 / 45.3 = 22.6 -> 16, as
    # diffusion-pipe rounds them (to the nearest multiple of 16)
    assert items(config) == sorted([("wide.mp4", 33, 0, (16, 48))] * 3
                                   + [("fast.mp4", 17, 0, (32, 32))] * 3 + [("uncaptioned.mp4", 17, 0, (32, 32))])


def test_diffusion_pipe_keys_we_cannot_honour_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "bad.toml").write_text("""
resolutions = [256, 512]
frame_buckets = [1, 33]
caption_prefix = "photo of "
size_buckets = [[512, 512, 1]]

[[directory]]
path = 'a'
""")
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["data.dataset_config=bad.toml"])
    text = str(caught.value)
    for expected in ("invalid configuration in bad.toml",
                     "resolutions: [256, 512]: exactly one resolution is supported",
                     "caption_prefix: not supported here", "size_buckets: not supported here",
                     "supported keys in the top level: ar_buckets, directory, enable_ar_bucket"):
        assert expected in text, text


# --------------------------------------------------------------------------------------- how the file is combined

def test_dataset_config_combines_with_the_config_and_overrides_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v").mkdir()
    (tmp_path / "own").mkdir()
    (tmp_path / "d.toml").write_text('[general]\nresolution = [832, 480]\nbatch_size = 4\n'
                                     '[[datasets]]\nvideo_directory = "v"\ntarget_frames = [17]\n')
    (tmp_path / "c.json").write_text(json.dumps({"data": {"concepts": [{"path": "own"}], "resolution": 256,
                                                          "dataset_config": "d.toml"}}))
    config = load_config("c.json", overrides=["batch_size=1"])
    assert [c.path for c in config.data.concepts] == ["own", "v"]
    assert config.batch_size == 1                     # --config-value wins over the dataset file
    assert (config.data.resolution, config.data.aspect_ratios) == ("832x480", [832 / 480])  # the file's, not 256
    save_config(config, tmp_path / "saved.json")      # a saved config reloads without doubling the file's concepts
    assert [c.path for c in load_config(str(tmp_path / "saved.json")).data.concepts] == ["own", "v"]


def test_a_config_built_from_a_dict_reads_its_dataset_config_too(tmp_path, monkeypatch):
    """The GUI builds its config with config_from_dict: a dataset file named there is read as well."""
    from modules.util.config.config_io import config_from_dict
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dirs").mkdir()
    (tmp_path / "d.toml").write_text("resolutions = [256]\n[[directory]]\npath = 'dirs'\nnum_repeats = 5\n")
    config = config_from_dict({"data": {"dataset_config": "d.toml"}})
    assert [(c.path, c.repeats) for c in config.data.concepts] == [("dirs", 5)] and config.data.resolution == 256


def test_dataset_config_flag_does_not_take_the_e2v_flag():
    args = train_script.parse_args(["--dataset_config", "d.toml"])
    assert (args.dataset_config, args.dataset_configs) == ("d.toml", None)
    args = train_script.parse_args(["--dataset_configs", "e2v.json"])
    assert (args.dataset_config, args.dataset_configs) == (None, "e2v.json")
    assert "data.dataset_config=d.toml" in train_script.seed_options_as_overrides(
        train_script.parse_args(["--dataset-config", "d.toml"]))


def test_each_extraction_mode_reports_the_rate_it_really_yields(tmp_path):
    """docs/data.md's table: a 40-frame clip at 16 fps cut at 33 frames; uniform spreads the 33 frames over all
    40, so its frames are 39/32 source frames apart and the real rate is 16 x 32 / 39."""
    from modules.dataLoader.pipeline.ListSource import ListSource
    from modules.dataLoader.pipeline.ProbeMedia import ProbeMedia
    clip = video(tmp_path / "clip.mp4", 40)
    np.savez(tmp_path / "nofps.npz", frames=np.zeros((40, 16, 16, 3), np.uint8))
    rates = {}
    for name, path, concept in [
            ("head", clip, ConceptConfig(path=".")), ("uniform", clip, ConceptConfig(path=".", extraction="uniform")),
            ("fps 8", clip, ConceptConfig(path=".", fps=8)), ("source", clip, ConceptConfig(path=".", fps="source")),
            ("npz", tmp_path / "nofps.npz", ConceptConfig(path="."))]:
        pipeline = Pipeline([ListSource([{"path": str(path), "concept": concept}], ["path", "concept"]), ProbeMedia(),
                             FrameWindow([1, 9, 17, 33], model_fps=16)], seed=0,
                            outputs=["frame_indices", "frame_bucket", "frame_fps"])
        pipeline.start_epoch(0)
        row = pipeline.get_item(0)
        rates[name] = (row["frame_bucket"], row["frame_indices"][-1], round(row["frame_fps"], 3))
    assert rates == {"head": (33, 32, 16.0), "uniform": (33, 39, round(16 * 32 / 39, 3)),
                     "fps 8": (17, 32, 8.0),  # 40 frames at 16 fps = 2.5 s = 20 frames at 8 fps: bucket 17
                     "source": (33, 32, 16.0), "npz": (33, 32, 16.0)}  # an npz without fps is at the target rate


def test_a_dataset_config_that_is_not_a_peer_toml_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "clips").mkdir()
    (tmp_path / "broken.toml").write_text("[[datasets]\nvideo_directory = 'clips'\n")
    (tmp_path / "other.toml").write_text("[training]\nepochs = 3\n")
    expected = {"clips": "is a folder, not a dataset TOML; give it as a concept instead",
                "broken.toml": "not valid TOML", "missing.toml": "does not exist (relative paths are read from",
                "other.toml": "neither a musubi-tuner dataset config ([[datasets]] tables) nor a diffusion-pipe one"}
    for name, message in expected.items():
        with pytest.raises(ConfigError) as caught:
            load_config(overrides=[f"data.dataset_config={name}"])
        assert message in str(caught.value) and name in str(caught.value)


def test_the_worked_example_config_of_docs_data_md_loads_as_documented(tmp_path, monkeypatch):
    """docs/data.md's seed 004 config, as printed there, over the preset its command names."""
    import re
    text = (ROOT / "docs" / "data.md").read_text()
    block = re.search(r"`configs/smoke_test\.json`.*?```json\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "smoke_test.json").write_text(block)
    config = load_config("configs/smoke_test.json",
                         str(ROOT / "training_presets" / "#wan 2.1 1.3B LoRA 24GB.json"))
    assert [c.path for c in config.data.concepts] == ["data/processed/train.jsonl"]
    assert (config.max_steps, config.batch_size, config.optimizer.gradient_accumulation_steps) == (50, 1, 4)
    assert (config.data.frame_buckets, config.data.resolution) == ([81], "480p")
    assert config.model.base_model_name == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
