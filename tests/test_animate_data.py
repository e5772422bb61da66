"""Wan2.2-Animate data: companions found beside each clip or in a manifest, frame-aligned through the clip's own frame
extraction, encoded by the condition code the sampler uses; a missing, short or copied companion is named."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.model import animate_condition as ac
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.config_io import load_config
from modules.util.demo_animate import animate_clip, make_animate_dataset
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import frames_to_tensor, resize_and_crop, write_video
from modules.util.video_io import probe_media, read_frames


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_animate_dataset(tmp_path_factory.mktemp("animate") / "set", clips_per_class=1, frames=9, size=32)


def _loader(concept, *values: str, mode: str = "animate", cache=None,
            variant: WanVariant = WanVariant.ANIMATE_14B) -> WanBaseDataLoader:
    overrides = [f"data.concepts=[{json.dumps({'path': str(concept)})}]", "data.frame_buckets=[5]",
                 "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0",
                 f"animate.mode={mode}", *values]
    if cache is not None:
        overrides.append(f"cache_dir={cache}")
    loader = WanBaseDataLoader(load_config(overrides=overrides), variant)
    loader.scan()
    return loader


def test_companions_are_found_and_are_not_clips(demo):
    for mode in ("animate", "replace"):
        scanned = _loader(demo, mode=mode).scan_result
        records = scanned.records
        assert scanned.skipped == []   # the companions are neither clips nor skipped files
        assert len(records) == 12 and all(not r["path"].endswith(("_pose.mp4", "_bg.mp4", "_mask.mp4", "_face.mp4"))
                                          for r in records)
        record = records[0]
        stem = record["path"].removesuffix(".mp4")
        assert record["companions"]["pose"] == stem + "_pose.mp4" and record["companions"]["reference"] == \
            stem + "_ref.png"
        assert record["mask"] is None   # `_mask` is the replace mask in an Animate set, not a loss mask
        assert (record["companions"]["mask"] is not None) == (mode == "replace")


def _one_clip(folder, pose_frames: int = 9, face: bool = True, pose_is_clip: bool = False):
    parts = animate_clip((220, 40, 40), "left", 9, 32)
    folder.mkdir(parents=True, exist_ok=True)
    write_video(folder / "c.mp4", parts["clip"], 30)
    write_video(folder / "c_pose.mp4", parts["clip"] if pose_is_clip else parts["pose"][:pose_frames], 30)
    if face:
        write_video(folder / "c_face.mp4", parts["face"], 30)
    Image.fromarray(parts["reference"]).save(folder / "c_ref.png")
    (folder / "c.txt").write_text("a person")
    return folder


@pytest.mark.parametrize("problem,expected", [
    (dict(face=False), "no face video (c_face.mp4 beside it"),
    (dict(pose_frames=5), "has 5 frames, shorter than the clip's 9"),
    (dict(pose_is_clip=True), "shows the clip itself, not a rendered pose"),
])
def test_bad_companions_are_named(tmp_path, problem, expected):
    from modules.dataLoader.WanBaseDataLoader import DataError
    with pytest.raises(DataError, match=expected.replace("(", r"\(")):
        _loader(_one_clip(tmp_path / "set", **problem))


def test_manifest_names_companions(tmp_path):
    folder = _one_clip(tmp_path / "media")
    for name in ("pose", "face"):
        (folder / f"c_{name}.mp4").rename(folder / f"{name}_of_c.mp4")
    manifest = tmp_path / "set.jsonl"
    manifest.write_text(json.dumps({"video": "media/c.mp4", "caption": "a person", "pose": "media/pose_of_c.mp4",
                                    "face": "media/face_of_c.mp4", "ref": "media/c_ref.png"}) + "\n")
    [record] = _loader(manifest).scan_result.records
    assert record["companions"]["pose"].endswith("pose_of_c.mp4")


@pytest.mark.parametrize("mode", ["animate", "replace"])
def test_items_are_the_condition_of_the_clips_own_frames(tiny_model, demo, tmp_path, mode):
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate"))))
    loader = _loader(demo, "data.crop_jitter=true", "animate.continuation_frames=1", mode=mode,
                     cache=tmp_path / "cache")
    loader.attach_model(model, torch.device("cpu"))
    names = ["path", "frame_indices", "crop", "companions", "latents", "condition", "pose_latents", "face_pixels",
             "image_embeds", "loss_mask"]
    items = Pipeline(loader._item_modules() + list(loader.encoders.values()), loader.config.seed, outputs=names)
    items.start_epoch(0)
    item = items.get_item(0)
    indices, crop, companions = list(item["frame_indices"]), item["crop"], item["companions"]
    assert len(indices) == 5 and item["latents"].shape == (16, 3, 4, 4)

    def read(path, size=32):
        frames = read_frames(path, indices, probe_media(path))
        return resize_and_crop(frames, size, size, crop["top"], crop["left"], crop["flip"])
    clip = frames_to_tensor(read(item["path"]))[None]
    face = read_frames(companions["face"], indices, probe_media(companions["face"]))
    face = ac.video_pixels([Image.fromarray(f) for f in face], 16, 16)
    reference = Image.open(companions["reference"]).convert("RGB")
    extra = {}
    if mode == "replace":
        extra = dict(background=frames_to_tensor(read(companions["background"]))[None],
                     mask=torch.from_numpy(read(companions["mask"])[..., 0].astype(np.float32) / 255)[None, None])
    with torch.no_grad():
        expected = ac.build_condition(model.vae, ac.reference_pixels(reference, 32, 32),
                                      frames_to_tensor(read(companions["pose"]))[None], face, 1, mode,
                                      previous=clip[:, :, :1], continuing=True, **extra)
        target = ac.denormalise(model.vae, torch.cat([expected.reference_latents[:, 4:, :1],
                                                      ac.encode_normalised(model.vae, clip)], dim=2))
    close = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(item["condition"], expected.reference_latents[0], **close)
    torch.testing.assert_close(item["pose_latents"], expected.pose_latents[0], **close)
    torch.testing.assert_close(item["face_pixels"], expected.face_pixels[0], **close)
    torch.testing.assert_close(item["latents"], target[0], **close)
    # no loss on the reference frame nor on the continuation frame's latent
    assert item["loss_mask"].flatten().tolist() == [0.0, 0.0, 1.0]
    # the cached item is read back, not encoded again
    again = Pipeline(loader._item_modules() + list(loader.encoders.values()), loader.config.seed, outputs=names)
    again.start_epoch(0)
    calls = loader.encode_calls()
    torch.testing.assert_close(again.get_item(0)["condition"], item["condition"], rtol=0, atol=0)
    assert loader.encode_calls() == calls


@pytest.fixture(scope="module")
def script_set(tmp_path_factory):
    """`make_demo_dataset --kind animate` with its defaults (one clip per colour and path)."""
    from tests.script_loader import load_script
    folder = tmp_path_factory.mktemp("animate-script") / "d"
    assert load_script("make_demo_dataset").main(["--kind", "animate", "--output", str(folder),
                                                  "--clips-per-class", "1"]) == 0
    return folder


def test_demo_dataset_script_writes_the_animate_set(script_set):
    assert len(_loader(script_set, mode="replace").scan_result.records) == 12


@pytest.mark.parametrize("preset", ["wan 2.2 Animate 14B LoRA 24GB", "wan 2.2 Animate 14B LoRA 16GB"])
def test_the_demo_set_trains_with_the_animate_presets_data_settings(script_set, preset):
    """Each of the script's clips makes an item in the preset's frame buckets at its resolution (9-frame clips, the
    script's old default, were all skipped: shorter than the presets' smallest bucket, 17)."""
    from modules.util.presets import resolve_preset
    config = load_config(preset_path=resolve_preset(preset), overrides=[
        f"data.concepts=[{json.dumps({'path': str(script_set)})}]", "data.dataloader_threads=0"])
    loader = WanBaseDataLoader(config, WanVariant.ANIMATE_14B)
    loader.scan()
    stats = loader.statistics()
    assert stats.skipped == [] and sum(counts["clips"] for counts in stats.per_concept.values()) == 12
    assert {frames for frames, _, _ in stats.buckets} <= set(config.data.frame_buckets)
