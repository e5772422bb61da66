"""VACE training data: a clip's control (`_control/` frames or `_control.mp4`), mask (`_mask`) and references
(`_ref.png`, `_ref2.png`) are found beside it or named in a manifest, read at the clip's own frames with its crop,
and made into the same control context the sampler makes (modules/model/vace_condition.py); mismatches are named."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.dataLoader.concept_scan import scan_concepts
from modules.model.vace_condition import image_to_tensor, model_encoder, vace_context
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.config_io import load_config
from modules.util.config.DataConfig import ConceptConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import write_video

FRAMES, SIZE = 9, 32


def _clip(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (FRAMES, SIZE // 8, SIZE // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)


def _dataset(folder, control_frames: int = FRAMES):
    folder.mkdir(parents=True)
    write_video(folder / "clip.mp4", _clip(0), 16)
    (folder / "clip.txt").write_text("a red square moving right\n")
    (folder / "clip_control").mkdir()
    for index, frame in enumerate(_clip(1)[:control_frames]):
        Image.fromarray(frame).save(folder / "clip_control" / f"{index:03d}.png")
    mask = np.zeros((SIZE, SIZE, 3), np.uint8)
    mask[:, SIZE // 2:] = 255
    Image.fromarray(mask).save(folder / "clip_mask.png")
    rng = np.random.default_rng(2)
    for name, shape in (("clip_ref2.png", (16, 24, 3)), ("clip_ref.png", (24, 16, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(folder / name)
    return folder


def test_companions_are_found_beside_the_clip_and_in_a_manifest(tmp_path):
    folder = _dataset(tmp_path / "data")
    [record] = scan_concepts([ConceptConfig(path=str(folder))]).records   # companions are no clips of their own
    assert record["control"] == str(folder / "clip_control") and record["mask"] == str(folder / "clip_mask.png")
    assert record["references"] == (str(folder / "clip_ref.png"), str(folder / "clip_ref2.png"))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"video_path": "data/clip.mp4", "caption": "x", "control_path": "data/clip_control",
                                    "reference_paths": ["data/clip_ref2.png"]}) + "\n"
                        + json.dumps({"video_path": "data/clip.mp4", "reference_paths": ["data/clip.mp4"]}) + "\n")
    scanned = scan_concepts([ConceptConfig(path=str(manifest))])
    [record] = scanned.records
    assert record["references"] == (str(folder / "clip_ref2.png"),) and record["control"].endswith("clip_control")
    assert "its reference " + str(folder / "clip.mp4") + " is not an image" in scanned.skipped[0][1]


def _loader(tmp_path, folder, model):
    config = load_config(overrides=[
        f"model.base_model_name={model}", f"cache_dir={tmp_path / 'cache'}", "device=cpu",
        f'data.concepts=[{{"path": "{folder}"}}]', "data.frame_buckets=[9]", "data.resolution=32",
        "data.aspect_ratios=[1.0]", "data.dataloader_threads=0"])
    loader = WanBaseDataLoader(config, WanVariant.VACE)
    loader.scan()
    return loader


def test_the_cached_context_is_the_samplers_context_of_the_same_files(tmp_path, tiny_model):
    folder = _dataset(tmp_path / "data")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-vace"))))
    loader = _loader(tmp_path, folder, tiny_model("wan2.1-vace"))
    loader.attach_model(model, torch.device("cpu"))
    loader.cache()
    batch = next(loader.batches(0))
    mask = torch.zeros(1, FRAMES, SIZE, SIZE)
    mask[..., SIZE // 2:] = 1
    references = [image_to_tensor(Image.open(folder / name)) for name in ("clip_ref.png", "clip_ref2.png")]
    with torch.no_grad():
        expected = vace_context(model_encoder(model), torch.from_numpy(_clip(1)).permute(3, 0, 1, 2).float() / 127.5 - 1,
                                mask, references)
    assert batch["vace_context"].shape == (1, 96, 2 + 3, SIZE // 8, SIZE // 8)
    torch.testing.assert_close(batch["vace_context"][0], expected, atol=1e-6, rtol=0)


def test_a_control_shorter_than_the_clip_is_named_and_the_clip_skipped(tmp_path, tiny_model):
    folder = _dataset(tmp_path / "data", control_frames=5)
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-vace"))))
    loader = _loader(tmp_path, folder, tiny_model("wan2.1-vace"))
    loader.attach_model(model, torch.device("cpu"))
    with pytest.raises(Exception, match="every file failed to decode"):
        loader.cache()
    [(path, reason)] = loader.scan_result.skipped
    assert path == str(folder / "clip.mp4")
    assert reason == f"{folder / 'clip_control'}: the control has 5 frames, the clip 9; a control must have the " \
                     f"clip's frames"


def test_the_demo_set_has_a_control_and_a_reference_per_clip(tmp_path):
    from modules.util.demo_vace import make_vace_dataset
    folder = make_vace_dataset(tmp_path / "demo", clips_per_class=1, frames=5, size=32)
    records = scan_concepts([ConceptConfig(path=str(folder))]).records
    assert len(records) == 6 and all(r["control"] and len(r["references"]) == 1 for r in records)
    control = np.asarray(Image.open(folder / "red_right_00_control" / "000.png"))[..., 0] > 0
    rows, columns = np.nonzero(control)
    # the square's outline: a closed rectangle border, nothing inside it
    assert control[rows.min(), columns.min():columns.max() + 1].all() and control[rows.min():rows.max() + 1,
                                                                                   columns.min()].all()
    assert not control[rows.min() + 2:rows.max() - 1, columns.min() + 2:columns.max() - 1].any()


@pytest.mark.parametrize("kind", ["musubi", "diffusion-pipe"])
def test_a_dataset_tomls_control_folder_gives_each_clip_its_control(kind, tmp_path, monkeypatch):
    """musubi-tuner's control_directory and diffusion-pipe's control_path: controls named as the clips."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v").mkdir()
    (tmp_path / "c").mkdir()
    for stem in ("one", "two"):
        write_video(tmp_path / "v" / f"{stem}.mp4", _clip(0), 16)
        (tmp_path / "v" / f"{stem}.txt").write_text("x\n")
    write_video(tmp_path / "c" / "one.mp4", _clip(1), 16)
    (tmp_path / "c" / "two").mkdir()   # a folder of frames named as the clip
    Image.fromarray(_clip(1)[0]).save(tmp_path / "c" / "two" / "000.png")
    (tmp_path / "v" / "two_control.mp4").write_bytes(b"")   # beside the clip: wins over the folder
    toml = ('[general]\nresolution = [32, 32]\n[[datasets]]\nvideo_directory = "v"\ncontrol_directory = "c"\n'
            if kind == "musubi" else "resolutions = [32]\nframe_buckets = [9]\n[[directory]]\npath = 'v'\n"
                                     "control_path = 'c'\n")
    (tmp_path / "dataset.toml").write_text(toml)
    config = load_config(overrides=["data.dataset_config=dataset.toml"])
    [concept] = config.data.concepts
    assert concept.control_path == "c"
    controls = {Path(r["path"]).stem: r["control"] for r in scan_concepts(config.data.concepts).records}
    assert controls == {"one": str(Path("c") / "one.mp4"), "two": str(Path("v") / "two_control.mp4")}


def test_e2v_elements_serve_as_vace_references_as_ref_companions_would(tmp_path, tiny_model):
    """`e2v.as_vace_references`: an E2V dataset trains a VACE model unchanged; each clip's elements, in slot order,
    give the control context its `_ref` / `_ref2` companions would give."""
    from modules.trainer.prepare import prepare_config
    from modules.util.demo_e2v import demo_e2v_config
    base = tiny_model("wan2.1-vace")
    rng = np.random.default_rng(5)
    e2v_folder, vace_folder = tmp_path / "e2v", tmp_path / "vace"
    for folder in (e2v_folder, vace_folder):
        folder.mkdir()
        write_video(folder / "clip.mp4", _clip(0), 16)
        (folder / "clip.txt").write_text("a red square moving right\n")
    person, toy = (rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(2))
    Image.fromarray(person).save(e2v_folder / "clip_person.png")   # slot 0 (main_subject)
    Image.fromarray(toy).save(e2v_folder / "clip_toy.png")         # slot 1 (secondary)
    Image.fromarray(person).save(vace_folder / "clip_ref.png")
    Image.fromarray(toy).save(vace_folder / "clip_ref2.png")
    e2v_config = tmp_path / "e2v.json"
    e2v_config.write_text(json.dumps(demo_e2v_config(e2v_folder)))
    common = [f"model.base_model_name={base}", "device=cpu", "data.frame_buckets=[9]", "data.resolution=32",
              "data.aspect_ratios=[1.0]", "data.dataloader_threads=0"]
    config = load_config(overrides=[*common, f"cache_dir={tmp_path / 'cache-e2v'}", f"e2v.dataset_config={e2v_config}",
                                    "e2v.as_vace_references=true"])
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    contexts = []
    for loader in (WanBaseDataLoader(config, WanVariant.VACE, prepare_config(config)),
                   _loader(tmp_path, vace_folder, base)):
        if not loader.scan_result.records:
            loader.scan()
        loader.attach_model(model, torch.device("cpu"))
        loader.cache()
        contexts.append(next(loader.batches(0))["vace_context"])
    assert contexts[0].shape == (1, 96, 2 + 3, SIZE // 8, SIZE // 8)   # two references before the 3 latent frames
    torch.testing.assert_close(contexts[0], contexts[1], atol=0, rtol=0)
