"""Wan2.2-Animate-2 data: the driving video and the reference found beside each clip or in a manifest, frame-aligned
through the clip's own frame extraction and encoded as the modular pipeline encodes a first segment; a missing, short,
unreadable or copied driving video is named and the clip skipped."""
import json

import pytest
import torch
from PIL import Image

from modules.dataLoader.WanBaseDataLoader import DataError, WanBaseDataLoader
from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.util.demo_animate import PERFORMER, animate_clip, make_animate_2_dataset
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import frames_to_tensor, resize_and_crop, write_video
from modules.util.video_io import probe_media, read_frames
from tests.test_animate_data import _loader as animate_loader


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_animate_2_dataset(tmp_path_factory.mktemp("animate-2") / "set", clips_per_class=1, frames=9, size=32)


def _loader(concept, *values: str, cache=None) -> WanBaseDataLoader:
    return animate_loader(concept, *values, cache=cache, variant=WanVariant.ANIMATE_2_14B)


def test_driving_videos_and_references_are_found_and_are_not_clips(demo):
    scanned = _loader(demo).scan_result
    assert scanned.skipped == [] and len(scanned.records) == 12
    record = scanned.records[0]
    stem = record["path"].removesuffix(".mp4")
    assert record["companions"] == {"driving": stem + "_driving.mp4", "reference": stem + "_ref.png"}


def _one_clip(folder, name="c", driving_frames: int = 9, driving: bool = True, driving_is_clip: bool = False):
    parts = animate_clip((220, 40, 40), "left", 9, 32)
    folder.mkdir(parents=True, exist_ok=True)
    write_video(folder / f"{name}.mp4", parts["clip"], 24)
    if driving:
        frames = parts["clip"] if driving_is_clip else animate_clip(PERFORMER, "left", 9, 32)["clip"]
        write_video(folder / f"{name}_driving.mp4", frames[:driving_frames], 24)
    Image.fromarray(parts["reference"]).save(folder / f"{name}_ref.png")
    (folder / f"{name}.txt").write_text("a person")
    return folder


@pytest.mark.parametrize("problem,expected", [
    (dict(driving=False), "no driving video (c_driving.mp4 beside it, or 'driving' in the manifest)"),
    (dict(driving_frames=5), "driving video .*c_driving.mp4 has 5 frames, shorter than the clip's 9"),
    (dict(driving_is_clip=True), "driving video .*c_driving.mp4 shows the clip itself, not another performer "
                                 "doing its motion: the model would learn to copy its input"),
])
def test_bad_driving_videos_are_named(tmp_path, problem, expected):
    with pytest.raises(DataError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _loader(_one_clip(tmp_path / "set", **problem))


def test_an_unreadable_driving_video_skips_only_its_clip(tmp_path):
    folder = _one_clip(tmp_path / "set")
    _one_clip(folder, "d")
    (folder / "d_driving.mp4").write_bytes(b"not a video")
    scanned = _loader(folder).scan_result
    assert [r["path"] for r in scanned.records] == [str(folder / "c.mp4")]
    [(path, reason)] = scanned.skipped
    assert str(path).endswith("d.mp4") and "d_driving.mp4" in reason


def test_manifest_names_the_driving_video(tmp_path):
    folder = _one_clip(tmp_path / "media")
    (folder / "c_driving.mp4").rename(folder / "performer.mp4")
    manifest = tmp_path / "set.jsonl"
    manifest.write_text(json.dumps({"video": "media/c.mp4", "caption": "a person", "driving": "media/performer.mp4",
                                    "ref": "media/c_ref.png"}) + "\n")
    [record] = _loader(manifest).scan_result.records
    assert record["companions"]["driving"].endswith("performer.mp4")


def test_items_are_the_first_segment_of_the_clips_own_frames(tiny_model, demo, tmp_path):
    from diffusers.modular_pipelines.wan_animate_2.encoders import clip_visual_encode, encode_vae

    from modules.dataLoader.pipeline.EncodeAnimate2 import REFERENCE_PROMPT, reference_pixels
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate-2"))))
    loader = _loader(demo, "data.crop_jitter=true", "data.flip=true", cache=tmp_path / "cache")
    loader.attach_model(model, torch.device("cpu"))
    names = ["path", "frame_indices", "crop", "companions", "latents", "condition", "driving_latents",
             "image_embeds", "driving_image_embeds", "loss_mask", "reference_text_embeds"]
    items = Pipeline(loader._item_modules() + list(loader.encoders.values()), loader.config.seed, outputs=names)
    items.start_epoch(0)
    item = items.get_item(0)
    indices, crop, companions = list(item["frame_indices"]), item["crop"], item["companions"]
    assert len(indices) == 5 and item["latents"].shape == (16, 3, 4, 4) and item["condition"].shape == (20, 3, 4, 4)

    def read(path):
        frames = read_frames(path, indices, probe_media(path))
        return frames_to_tensor(resize_and_crop(frames, 32, 32, crop["top"], crop["left"], crop["flip"]))[None]
    driving = read(companions["driving"])
    image = reference_pixels(Image.open(companions["reference"]).convert("RGB"), 32, 32)
    with torch.no_grad():
        reference = encode_vae(model.vae, image.unsqueeze(2))[0]
        close = dict(rtol=0, atol=1e-5)
        torch.testing.assert_close(item["driving_latents"], encode_vae(model.vae, driving)[0], **close)
        torch.testing.assert_close(model.normalize_latents(item["latents"][None])[0],
                                   torch.cat([reference, encode_vae(model.vae, read(item["path"]))[0]], 1), **close)
        torch.testing.assert_close(item["condition"][4:, :1], reference, **close)
        assert item["condition"][:4, 0].eq(1).all() and item["condition"][:4, 1:].eq(0).all()
        torch.testing.assert_close(item["driving_image_embeds"],
                                   clip_visual_encode(model.image_encoder, driving[0, :, 0], "cpu", torch.float32)[0],
                                   **close)
        torch.testing.assert_close(item["reference_text_embeds"], model.encode_text([REFERENCE_PROMPT])[0], **close)
    assert item["loss_mask"].flatten().tolist() == [0.0, 1.0, 1.0]   # never the reference slot


def test_continuation_items_are_conditioned_as_the_sampler_continues_a_segment(tiny_model, demo, tmp_path):
    """With animate.continuation_frames=5 the clip's own first 5 frames stand for the previous segment's last 5
    generated frames: the condition is the sampler's for a later segment, and the loss leaves out the reference slot
    and the two latent frames those 5 frames occupy, nothing else."""
    from modules.dataLoader.pipeline.EncodeAnimate2 import reference_pixels
    from modules.model.animate_2_condition import reference_image_latents, reference_latents
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate-2"))))
    loader = _loader(demo, "data.frame_buckets=[9]", "animate.continuation_frames=5", cache=tmp_path / "cache")
    loader.attach_model(model, torch.device("cpu"))
    names = ["path", "frame_indices", "crop", "companions", "condition", "loss_mask"]
    items = Pipeline(loader._item_modules() + list(loader.encoders.values()), loader.config.seed, outputs=names)
    items.start_epoch(0)
    item = items.get_item(0)
    indices, crop = list(item["frame_indices"]), item["crop"]
    assert len(indices) == 9 and item["condition"].shape == (20, 4, 4, 4)
    clip = frames_to_tensor(resize_and_crop(read_frames(item["path"], indices, probe_media(item["path"])), 32, 32,
                                            crop["top"], crop["left"], crop["flip"]))[None]
    image = reference_pixels(Image.open(item["companions"]["reference"]).convert("RGB"), 32, 32)
    with torch.no_grad():
        expected = reference_latents(model.vae, reference_image_latents(model.vae, image), 9,
                                     previous=clip[:, :, :5])[0]
    torch.testing.assert_close(item["condition"], expected, rtol=0, atol=1e-5)
    assert item["condition"][:4, :3].eq(1).all() and item["condition"][:4, 3:].eq(0).all()
    assert item["loss_mask"].flatten().tolist() == [0.0, 0.0, 0.0, 1.0]


def test_demo_dataset_script_writes_the_animate_2_set(tmp_path):
    from tests.script_loader import load_script
    assert load_script("make_demo_dataset").main(["--kind", "animate-2", "--output", str(tmp_path / "d"),
                                                  "--clips-per-class", "1"]) == 0
    assert len(_loader(tmp_path / "d").scan_result.records) == 12
