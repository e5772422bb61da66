"""Issue 3: WanBaseDataLoader scans concepts, caches encodings on disk keyed by what changes them, skips bad media
with a count, and batches one bucket at a time."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.dataLoader.WanBaseDataLoader import DataError, WanBaseDataLoader
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.config_io import load_config
from modules.util.config.ModelConfig import ModelConfig
from modules.util.demo_assets import COLOURS, square_clip
from modules.util.video_frames import write_video


@pytest.fixture(scope="module")
def t2v_model(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))


def make_loader(tmp_path, concepts, model=None, *overrides):
    config = load_config(overrides=[f"data.concepts={json.dumps(concepts)}", f"cache_dir={tmp_path / 'cache'}",
                                    "data.frame_buckets=[1, 5, 9]", "data.resolution=32", "data.aspect_ratios=[1.0]",
                                    "batch_size=2", "data.dataloader_threads=0", *overrides])
    loader = WanBaseDataLoader(config)
    loader.scan()
    if model is not None:
        loader.attach_model(model, torch.device("cpu"))
    return loader


def write_clips(folder: Path, count: int = 4, frames: int = 9) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        colour = list(COLOURS)[i % 3]
        write_video(folder / f"clip{i}.mp4", square_clip(COLOURS[colour], "left", frames, 32, i), 16)
        (folder / f"clip{i}.txt").write_text(f"a {colour} square")
    return folder


def all_batches(loader, epoch=0):
    return list(loader.batches(epoch))


def test_warm_epoch_makes_no_encoder_call(t2v_model, tmp_path):
    data = write_clips(tmp_path / "data")
    loader = make_loader(tmp_path, [{"path": str(data)}], t2v_model)
    loader.cache()
    calls = {name: m.encode_calls for name, m in loader.encoders.items()}
    assert calls == {"EncodeVideo": 4, "EncodeText": 3}  # four clips, three distinct captions
    first = all_batches(loader, 0)
    second = all_batches(loader, 1)
    assert {name: m.encode_calls for name, m in loader.encoders.items()} == calls
    assert sum(len(b["prompt"]) for b in first) == sum(len(b["prompt"]) for b in second) == 4
    for batch in first:
        assert batch["latents"].shape[1:] == (16, 3, 4, 4) and batch["text_embeds"].shape[1:] == (512, 32)


def test_resolution_change_reencodes_only_latents(t2v_model, tmp_path):
    data = write_clips(tmp_path / "data")
    make_loader(tmp_path, [{"path": str(data)}], t2v_model).cache()
    loader = make_loader(tmp_path, [{"path": str(data)}], t2v_model, "data.resolution=48")
    loader.cache()
    assert loader.encoders["EncodeVideo"].encode_calls == 4
    assert loader.encoders["EncodeText"].encode_calls == 0
    assert all_batches(loader)[0]["latents"].shape[-2:] == (6, 6)


def test_killed_caching_run_resumes(t2v_model, tmp_path, monkeypatch):
    data = write_clips(tmp_path / "data")
    loader = make_loader(tmp_path, [{"path": str(data)}], t2v_model)
    encoder = loader.encoders["EncodeVideo"]
    original = encoder._encode

    def dies_on_third(video):
        if encoder.encode_calls == 2:
            raise KeyboardInterrupt
        return original(video)

    monkeypatch.setattr(encoder, "_encode", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        loader.cache()
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # no half-written entry
    resumed = make_loader(tmp_path, [{"path": str(data)}], t2v_model)
    resumed.cache()
    assert resumed.encoders["EncodeVideo"].encode_calls == 2  # only the items the killed run had not finished


def test_bad_inputs_are_skipped_warned_and_counted(t2v_model, tmp_path, caplog):
    data = write_clips(tmp_path / "data", count=2)
    (data / "zero.mp4").write_bytes(b"")
    (data / "zero.txt").write_text("x")
    (data / "garbage.mp4").write_bytes(b"\x00not a video" * 100)
    (data / "garbage.txt").write_text("x")
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    (data / "broken.txt").write_text("x")
    good = (data / "clip0.mp4").read_bytes()
    (data / "truncated.mp4").write_bytes(good[: len(good) // 2])
    (data / "truncated.txt").write_text("x")
    write_video(data / "short.mp4", square_clip(COLOURS["red"], "left", 3, 32, 0), 16)
    (data / "short.txt").write_text("x")
    shutil.copy(data / "clip1.mp4", data / "nocaption.mp4")
    loader = make_loader(tmp_path, [{"path": str(data)}], t2v_model, "data.frame_buckets=[5, 9]")
    loader.cache()
    report = loader.report()
    skipped = {Path(p).name for p, _ in loader.scan_result.skipped + list(_pipeline_skips(loader))}
    assert {"zero.mp4", "garbage.mp4", "broken.png", "truncated.mp4", "short.mp4", "nocaption.mp4"} <= skipped
    assert "skipped files: 6" in report
    assert sum(len(b["prompt"]) for b in all_batches(loader)) == 2
    assert "nocaption.mp4" in caplog.text and "truncated.mp4" in caplog.text


def _pipeline_skips(loader):
    from modules.dataLoader.pipeline.Pipeline import Pipeline
    items = Pipeline(loader._item_modules(), loader.config.seed)
    items.start_epoch(0)
    return items.skipped


def test_no_usable_item_is_an_error_before_any_model(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.mp4").write_bytes(b"")
    (data / "a.txt").write_text("x")
    with pytest.raises(DataError, match="(?s)no usable training item.*a.mp4: the file is empty"):
        make_loader(tmp_path, [{"path": str(data)}])


def test_jsonl_and_npz_give_the_same_items_as_the_folder(t2v_model, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    npz_dir = tmp_path / "npz"
    npz_dir.mkdir()
    manifest = []
    for i, colour in enumerate(COLOURS):
        clip = square_clip(COLOURS[colour], "right", 9, 32, i)
        write_video(folder / f"{colour}.mp4", clip, 16)
        (folder / f"{colour}.txt").write_text(f"a {colour} square")
        # the npz holds the frames as decoded from the mp4, so both paths see identical pixels
        from modules.util.video_io import read_media
        frames = read_media(folder / f"{colour}.mp4")
        frames = frames[0] if isinstance(frames, tuple) else frames
        np.savez(npz_dir / f"{colour}.npz", frames=frames, fps=16)
        manifest.append({"path": f"npz/{colour}.npz", "prompt": f"a {colour} square"})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(m) for m in manifest))
    by_folder = make_loader(tmp_path / "a", [{"path": str(folder)}], t2v_model)
    by_manifest = make_loader(tmp_path / "b", [{"path": str(tmp_path / "train.jsonl")}], t2v_model)

    def items(loader):
        return sorted((p, l.sum().item()) for b in all_batches(loader) for p, l in zip(b["prompt"], b["latents"]))

    for (prompt_a, sum_a), (prompt_b, sum_b) in zip(items(by_folder), items(by_manifest)):
        assert prompt_a == prompt_b
        assert sum_a == pytest.approx(sum_b, rel=1e-5)


def test_caption_sources_and_repeats(tmp_path):
    data = write_clips(tmp_path / "data", count=2)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("one prompt for all")
    loader = make_loader(tmp_path, [{"path": str(data), "caption_source": "prompt_file", "prompt_path": str(prompt),
                                     "repeats": 3}])
    assert {r["caption"] for r in loader.scan_result.records} == {"one prompt for all"}
    by_name = make_loader(tmp_path, [{"path": str(data), "caption_source": "filename"}])
    assert sorted(r["caption"] for r in by_name.scan_result.records) == ["clip0", "clip1"]


def test_concept_seed_changes_only_that_concepts_draws(tmp_path):
    data = write_clips(tmp_path / "data", count=4)

    def dropped(seed):
        loader = make_loader(tmp_path, [{"path": str(data), "caption_dropout": 0.5, "seed": seed}])
        from modules.dataLoader.pipeline.Pipeline import Pipeline
        items = Pipeline(loader._item_modules(), 0, outputs=["prompt"])
        items.start_epoch(0)
        return [items.get_item(i)["prompt"] == "" for i in range(len(items))]

    assert dropped(1) == dropped(1)
    assert any(dropped(seed) != dropped(1) for seed in range(2, 8))
