"""Issue 25 item 4 without a display: the dataset viewer's items (frames, fps, bucket, skip reason), search and
filters, and a caption edit that makes the next caching encode the new text (the text cache is keyed by content)."""
from pathlib import Path

import pytest
import torch

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.ui import DatasetBrowser as browser
from modules.util.config.config_io import load_config
from modules.util.config.ModelConfig import ModelConfig
from modules.util.demo_assets import COLOURS, square_clip
from modules.util.video_frames import write_video


def dataset(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i, colour in enumerate(("red", "green", "blue")):
        write_video(folder / f"clip{i}.mp4", square_clip(COLOURS[colour], "left", 9, 32, i), 16)
        (folder / f"clip{i}.txt").write_text(f"a {colour} square")
    (folder / "broken.mp4").write_bytes(b"not a video")
    (folder / "broken.txt").write_text("broken")
    return folder


def config_for(tmp_path, data):
    return load_config(overrides=[f'data.concepts=[{{"path": "{data}"}}]', f"cache_dir={tmp_path / 'cache'}",
                                  "data.frame_buckets=[1, 5, 9]", "data.resolution=32", "data.aspect_ratios=[1.0]",
                                  "batch_size=1", "data.dataloader_threads=0"])


def test_items_show_frames_fps_bucket_and_skip_reason_and_filter(tmp_path):
    data = dataset(tmp_path / "data")
    items = browser.browse(config_for(tmp_path, data), 0)
    assert [Path(i.path).name for i in items] == ["broken.mp4", "clip0.mp4", "clip1.mp4", "clip2.mp4"]
    clip = items[1]
    assert (clip.frames, round(clip.fps), clip.bucket, clip.caption, clip.skip_reason) == \
        (9, 16, "9 x 32x32", "a red square", "")
    assert items[0].skipped and items[0].bucket == ""
    assert [Path(i.path).name for i in browser.select(items, "GREEN square")] == ["clip1.mp4"]
    assert [Path(i.path).name for i in browser.select(items, skipped=True)] == ["broken.mp4"]
    assert len(browser.select(items, bucket="9 x 32x32")) == 3
    assert [frame.shape for frame in browser.thumbnails(clip)] == [(32, 32, 3)] * 3


def test_a_saved_caption_is_written_atomically_and_the_next_caching_encodes_it(tmp_path, tiny_model):
    data = dataset(tmp_path / "data")
    config = config_for(tmp_path, data)
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))

    def cached_loader():
        loader = WanBaseDataLoader(config)
        loader.scan()
        loader.attach_model(model, torch.device("cpu"))
        loader.cache()
        return loader

    first = cached_loader()
    assert first.encoders["EncodeText"].encode_calls == 3
    clip = browser.browse(config, 0)[1]
    browser.save_caption(clip, "a red square, edited  ")
    assert Path(clip.caption_file).read_text() == "a red square, edited\n"
    assert not list(data.glob("*.tmp*"))   # the atomic write left no temporary file
    second = cached_loader()
    # exactly the edited caption is encoded again; the other two come from the cache
    assert second.encoders["EncodeText"].encode_calls == 1
    prompts = {batch["prompt"][0] for batch in second.batches(0)}
    assert "a red square, edited" in prompts and "a red square" not in prompts


def test_a_caption_that_is_not_a_file_is_refused(tmp_path):
    item = browser.DatasetItem("clip.mp4", caption="x")
    with pytest.raises(ValueError, match="caption_source"):
        browser.save_caption(item, "y")
