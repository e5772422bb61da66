"""Video / image / npz loading, fps resampling, extraction modes, buckets, resize-crop and bad input.

The synthetic videos carry their frame number as a 7-bit code of 16x16 black / white squares on grey, which
survives H.264 compression; the expected source frames are computed here from the resampling rule directly."""
import os
import random
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import av  # noqa: E402
import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from modules.dataLoader.pipeline.BucketBatch import BucketBatch  # noqa: E402
from modules.dataLoader.pipeline.FrameWindow import FrameWindow  # noqa: E402
from modules.dataLoader.pipeline.ListSource import ListSource  # noqa: E402
from modules.dataLoader.pipeline.LoadVideo import LoadVideo  # noqa: E402
from modules.dataLoader.pipeline.Pipeline import Pipeline  # noqa: E402
from modules.dataLoader.pipeline.ProbeMedia import ProbeMedia  # noqa: E402
from modules.dataLoader.pipeline.ResizeCropVideo import ResizeCropVideo  # noqa: E402
from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket  # noqa: E402
from modules.util.config.DataConfig import ConceptConfig  # noqa: E402
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames, read_media  # noqa: E402
from modules.util.video_frames import resize_and_crop, write_video  # noqa: E402

HEIGHT, WIDTH = 64, 96
BUCKETS = [1, 5, 9, 17, 33]
RATIOS = [16 / 9, 4 / 3, 1.0, 3 / 4, 9 / 16]


def code_frame(i):
    frame = np.full((HEIGHT, WIDTH, 3), 128, np.uint8)
    for bit in range(7):
        y, x = (bit // 6) * 16, (bit % 6) * 16
        frame[y:y + 16, x:x + 16] = 255 if (i >> bit) & 1 else 0
    return frame


def read_code(frame):
    return sum(1 << bit for bit in range(7)
               if frame[(bit // 6) * 16 + 4:(bit // 6) * 16 + 12, (bit % 6) * 16 + 4:(bit % 6) * 16 + 12].mean() > 128)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    frames = np.stack([code_frame(i) for i in range(60)])
    paths = {"v30": root / "v30.mp4", "v16": root / "v16.mp4", "npz30": root / "c30.npz",
             "npz_nofps": root / "c.npz", "png": root / "still.png", "gif": root / "vfr.gif", "short": root / "s.mp4"}
    write_video(paths["v30"], frames, 30)  # 2 s
    write_video(paths["v16"], frames[:40], 16)  # 2.5 s
    write_video(paths["short"], frames[:4], 16)  # shorter than the smallest bucket but one
    np.savez(paths["npz30"], frames=frames, fps=np.float32(30))
    np.savez_compressed(paths["npz_nofps"], frames[:40])  # key arr_0, no fps: taken to be at the target rate
    Image.fromarray(code_frame(5)).save(paths["png"])
    images = [Image.fromarray(code_frame(i)) for i in range(8)]
    images[0].save(paths["gif"], save_all=True, append_images=images[1:], duration=GIF_DURATIONS_MS, loop=0)
    return {k: str(v) for k, v in paths.items()}


GIF_DURATIONS_MS = [100, 50, 150, 100, 200, 50, 100, 100]


def expected_resampled(times, end, fps):
    """Output j (time j / fps) shows the last source frame with time <= j / fps; j runs while j / fps < end."""
    result, j = [], 0
    while Fraction(j, fps) < end:
        result.append(max(i for i, t in enumerate(times) if t <= Fraction(j, fps)))
        j += 1
    return result


def half_up(numerator, denominator):
    return (2 * numerator + denominator) // (2 * denominator)


def clip_pipeline(path, concept, threads=0, no_upscale=False, jitter=False, flip=False, seed=0):
    modules = [ListSource([{"path": path, "concept": concept}], ["path", "concept"]), ProbeMedia(),
               FrameWindow(BUCKETS, model_fps=16), LoadVideo(), ResolutionBucket(64, RATIOS, 16, no_upscale),
               ResizeCropVideo(crop_jitter=jitter, flip=flip)]
    return Pipeline(modules, seed=seed, threads=threads)


def codes(item):
    return [read_code(frame) for frame in item["frames"]]


# ----------------------------------------------------------------------------------------------------------- resampling

def test_probe_and_resampling_rule(media):
    info = probe_media(media["v30"])
    assert (info.kind, info.frame_count, info.width, info.height) == ("video", 60, WIDTH, HEIGHT)
    assert info.timestamps == tuple(Fraction(i, 30) for i in range(60)) and info.end_time == 2
    resampled = info.resample(16)
    assert resampled == [j * 30 // 16 for j in range(32)]
    assert resampled == expected_resampled([Fraction(i, 30) for i in range(60)], Fraction(2), 16)
    assert probe_media(media["v16"]).resample(16) == list(range(40))
    assert info.resample(None) == list(range(60))

    # a variable-frame-rate GIF: the frame times come from the file, not from an assumed rate
    gif = probe_media(media["gif"])
    times = [Fraction(sum(GIF_DURATIONS_MS[:i]), 1000) for i in range(8)]
    assert list(gif.timestamps) == times and gif.end_time == Fraction(sum(GIF_DURATIONS_MS), 1000)
    expected = expected_resampled(times, gif.end_time, 16)
    assert gif.resample(16) == expected and expected.count(4) == 3  # 200 ms: 3 outputs
    assert [read_code(f) for f in read_frames(media["gif"], expected, gif)] == expected


def test_decoding_by_index_and_seek(media):
    info = probe_media(media["v30"])
    assert [read_code(f) for f in read_frames(media["v30"], [0, 5, 59, 30, 30], info)] == [0, 5, 59, 30, 30]
    assert [read_code(f) for f in read_frames(media["v30"], range(41, 47))] == list(range(41, 47))
    whole = read_media(media["v16"], target_fps=16)
    assert whole.shape == (40, HEIGHT, WIDTH, 3) and whole.dtype == np.uint8
    assert [read_code(f) for f in whole] == list(range(40))
    assert read_media(media["v30"], target_fps=16, max_frames=5).shape[0] == 5


# ----------------------------------------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("source", ["v30", "npz30", "v16", "npz_nofps"])
def test_extraction_modes_pick_the_expected_frames(media, source):
    fps = 30 if source in ("v30", "npz30") else 16
    n = {30: 32, 16: 40}[fps]  # resampled frame counts: 2 s and 2.5 s at 16 fps

    def source_of(position):  # resampled position -> source frame: floor(j * fps / 16)
        return position * fps // 16

    f = 17 if n == 32 else 33  # the largest bucket <= n
    cases = {
        ("head", 81): [source_of(p) for p in range(f)],
        ("head", 12): [source_of(p) for p in range(9)],  # max_frames caps the bucket
        ("uniform", 81): [source_of(half_up(i * (n - 1), f - 1)) for i in range(f)],
        ("full", 81): [source_of(p) for p in range((n - 1) // 4 * 4 + 1)],
        ("full", 22): [source_of(p) for p in range(21)],
    }
    for (mode, max_frames), expected in cases.items():
        pipeline = clip_pipeline(media[source], ConceptConfig(path=".", extraction=mode, max_frames=max_frames))
        items = list(pipeline.iterate(0))
        assert len(items) == 1
        assert codes(items[0]) == expected, (mode, max_frames)
        assert items[0]["frame_bucket"] == len(expected)
        assert items[0]["resolution_bucket"] == (48, 80)
        assert items[0]["video"].shape == (3, len(expected), 48, 80)

    stride = 4
    slide = list(clip_pipeline(media[source], ConceptConfig(path=".", extraction="slide", slide_stride=stride))
                 .iterate(0))
    starts = list(range(0, n - f + 1, stride))
    assert [codes(item) for item in slide] == [[source_of(s + p) for p in range(f)] for s in starts]

    random_pipeline = clip_pipeline(media[source], ConceptConfig(path=".", extraction="random"), seed=3)
    random_starts = []
    for epoch in range(4):
        got = codes(next(random_pipeline.iterate(epoch)))
        start = next(s for s in range(n - f + 1) if got == [source_of(s + p) for p in range(f)])
        random_starts.append(start)
    assert len(set(random_starts)) > 1  # a new window each epoch ...
    assert codes(next(clip_pipeline(media[source], ConceptConfig(path=".", extraction="random"), seed=3)
                      .iterate(2))) == [source_of(random_starts[2] + p) for p in range(f)]  # ... replayable


def test_source_fps_and_images(media):
    keep = list(clip_pipeline(media["v30"], ConceptConfig(path=".", fps="source")).iterate(0))[0]
    assert codes(keep) == list(range(33)) and keep["frame_fps"] == 30
    eight = list(clip_pipeline(media["v30"], ConceptConfig(path=".", fps=8)).iterate(0))[0]
    assert codes(eight) == [j * 30 // 8 for j in range(9)]  # 2 s at 8 fps = 16 frames -> bucket 9

    image = list(clip_pipeline(media["png"], ConceptConfig(path=".", extraction="uniform")).iterate(0))[0]
    assert image["frame_bucket"] == 1 and codes(image) == [5]
    assert image["video"].shape == (3, 1, 48, 80)
    assert -1.0 <= image["video"].min() < 0 < image["video"].max() <= 1.0


def test_short_and_unreadable_files_are_skipped_with_reasons(media, tmp_path):
    garbage = tmp_path / "garbage.mp4"
    # Fixed bytes: random ones sometimes parse as a container without a video stream, a different (also valid) reason.
    garbage.write_bytes(random.Random(0).randbytes(2000))
    records = [{"path": p, "concept": ConceptConfig(path=".")} for p in (media["short"], str(garbage), media["v16"])]
    modules = [ListSource(records, ["path", "concept"]), ProbeMedia(), FrameWindow([9, 17], model_fps=16),
               LoadVideo()]
    pipeline = Pipeline(modules, seed=0)
    items = list(pipeline.iterate(0))
    assert [item["frame_bucket"] for item in items] == [17]
    reasons = dict(pipeline.skipped)
    assert set(reasons) == {media["short"], str(garbage)}
    assert "4 frame(s) at 16 fps is shorter than the smallest frame bucket (9)" in reasons[media["short"]]
    assert "cannot decode" in reasons[str(garbage)]


# ----------------------------------------------------------------------------------------------------------- buckets

def test_resolution_buckets():
    buckets = ResolutionBucket.make_buckets(480, RATIOS, 16)
    # 16:9 -> 480 / sqrt(16/9) = 360 -> 22.5 units -> 23 -> 368; 480 * 4/3 = 640
    assert buckets == [(368, 640), (416, 560), (480, 480), (560, 416), (640, 368)]
    assert all(h % 16 == 0 and w % 16 == 0 for h, w in buckets)
    assert ResolutionBucket.choose(832, 480, buckets, 16) == (368, 640)
    assert ResolutionBucket.choose(480, 832, buckets, 16) == (640, 368)
    assert ResolutionBucket.choose(500, 520, buckets, 16) == (480, 480)
    assert ResolutionBucket.choose(1000, 740, buckets, 16) == (416, 560)
    # no_upscale: 320x180 would need 640x368; it keeps its own size instead, floored to units
    assert ResolutionBucket.choose(320, 180, buckets, 16, no_upscale=True) == (176, 320)
    assert ResolutionBucket.choose(320, 180, buckets, 16, no_upscale=False) == (368, 640)
    assert ResolutionBucket.choose(1920, 1080, buckets, 16, no_upscale=True) == (368, 640)
    five_b = ResolutionBucket.make_buckets(704, [16 / 9, 1.0], 32)  # TI2V-5B: sides are multiples of 32
    assert five_b == [(544, 928), (704, 704)]


def test_resize_crop_flip_and_no_upscale(media):
    frames = np.stack([code_frame(3), code_frame(4)])
    out = resize_and_crop(frames, 48, 80)
    scaled = cv2.resize(frames[0], (80, 53), interpolation=cv2.INTER_AREA)  # 96x64 * 5/6 = 80x53.3 -> 80x53
    assert np.array_equal(out[0], scaled[2:50])  # centre crop: (53 - 48) // 2 = 2
    assert np.array_equal(resize_and_crop(frames, 48, 80, flip=True), out[:, :, ::-1])
    big = resize_and_crop(frames, 128, 192)
    assert np.array_equal(big[0], cv2.resize(frames[0], (192, 128), interpolation=cv2.INTER_CUBIC))

    small = list(clip_pipeline(media["v16"], ConceptConfig(path="."), no_upscale=True).iterate(0))[0]
    assert small["resolution_bucket"] == (48, 80)  # fits inside 96x64 already
    concept = ConceptConfig(path=".", extraction="head", max_frames=5)
    flips = []
    for epoch in range(6):
        item = next(clip_pipeline(media["v16"], concept, jitter=True, flip=True, seed=1).iterate(epoch))
        crop = item["crop"]
        scaled = np.stack([cv2.resize(f, (80, 53), interpolation=cv2.INTER_AREA) for f in item["frames"]])
        expected = scaled[:, crop["top"]:crop["top"] + 48, crop["left"]:crop["left"] + 80]
        if crop["flip"]:
            expected = expected[:, :, ::-1]
        video = ((item["video"] + 1) * 127.5).round().permute(1, 2, 3, 0).to(torch.uint8).numpy()
        assert np.array_equal(video, expected)
        flips.append((crop["flip"], crop["top"]))
    assert len(set(flips)) > 1


# ----------------------------------------------------------------------------------------------------------- batches

def test_video_batches_deterministic_resumable_and_thread_independent(media):
    records = [{"path": media[k], "concept": ConceptConfig(path=".", extraction="random", max_frames=9)}
               for k in ("v30", "v16", "npz30", "png", "gif", "v30")]

    def batches(epoch, threads=0, start=0):
        modules = [ListSource(records, ["path", "concept"]), ProbeMedia(), FrameWindow([1, 5, 9], model_fps=16),
                   LoadVideo(), ResolutionBucket(64, RATIOS, 16), ResizeCropVideo(crop_jitter=True, flip=True),
                   BucketBatch(["video", "path", "frame_indices"], batch_size=2)]
        pipeline = Pipeline(modules, seed=11, threads=threads)
        return [(b["path"], b["frame_indices"], b["video"].shape, b["video"].sum().item())
                for b in pipeline.iterate(epoch, start_index=start)]

    epoch1 = batches(1)
    assert sorted(p for b in epoch1 for p in b[0]) == sorted(r["path"] for r in records)
    assert all(shape[0] == len(paths) for paths, _, shape, _ in epoch1)
    assert batches(1) == epoch1
    assert batches(1, threads=2) == epoch1
    assert batches(1, threads=2, start=2) == epoch1[2:]
    assert batches(1, start=3) == epoch1[3:]
    assert batches(2) != epoch1


# ----------------------------------------------------------------------------------------------------------- writing

def test_write_video_pads_odd_sides(tmp_path):
    frames = np.zeros((3, 21, 33, 3), np.uint8)
    frames[:, :, :16] = 200
    path = tmp_path / "odd.mp4"
    write_video(path, frames, 24)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert (stream.codec_context.width, stream.codec_context.height) == (34, 22)
    back = read_media(path)
    assert back.shape == (3, 22, 34, 3)
    assert abs(int(back[0, 10, 4, 0]) - 200) < 6 and back[0, 10, 30, 0] < 6
    with pytest.raises(ValueError, match="uint8"):
        write_video(tmp_path / "bad.mp4", frames.astype(np.float32), 24)
    assert sorted(os.listdir(tmp_path)) == ["odd.mp4"]  # no temporary file left behind


# ----------------------------------------------------------------------------------------------------------- bad input

def test_bad_input_raises_unreadable_media_error(media, tmp_path):
    noisy = tmp_path / "noisy.mp4"
    write_video(noisy, np.random.default_rng(2).integers(0, 256, (12, 64, 64, 3), dtype=np.uint8), 16)
    faststart_cut = tmp_path / "cut_faststart.mp4"  # index first: the frames it lists are missing
    faststart_cut.write_bytes(noisy.read_bytes()[:noisy.stat().st_size * 6 // 10])
    plain = tmp_path / "plain.mp4"
    with av.open(str(plain), "w") as container:  # PyAV's default layout: index at the end
        stream = container.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(8):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), i * 20, np.uint8))):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    plain_cut = tmp_path / "cut_plain.mp4"
    plain_cut.write_bytes(plain.read_bytes()[:plain.stat().st_size * 2 // 3])
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    bad_png = tmp_path / "bad.png"
    bad_png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10)
    cut_png = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(cut_png)
    cut_png.write_bytes(cut_png.read_bytes()[:3000])
    bad_npz = tmp_path / "bad.npz"
    np.savez(bad_npz, frames=np.zeros((4, 8, 8), np.float32))
    unknown = tmp_path / "notes.txt"
    unknown.write_text("hello")

    cases = {faststart_cut: "truncated: its index lists 12 frames but only", empty: r"empty \(0 bytes\)",
             plain_cut: "no video stream|cannot decode", garbage: "cannot decode", bad_png: "cannot read the image",
             cut_png: "cannot read the image", bad_npz: r"uint8 \(T, H, W, 3\)", unknown: "unsupported file type",
             tmp_path / "missing.mp4": "cannot read the file"}
    for path, reason in cases.items():
        with pytest.raises(UnreadableMediaError, match=reason) as caught:
            probe_media(path)
        assert caught.value.path == str(path) and str(path) in str(caught.value)
    # decoding stops at the last frame needed: the head of the cut file still reads with the intact file's probe
    intact = probe_media(noisy)
    assert read_frames(faststart_cut, [0, 1, 2], intact).shape == (3, 64, 64, 3)
    with pytest.raises(UnreadableMediaError, match="cannot decode|stream ended before frame") as caught:
        read_frames(faststart_cut, [11], intact)
    assert caught.value.path == str(faststart_cut)
    not_zip = tmp_path / "array.npz"
    np.save(not_zip, np.zeros((2, 8, 8, 3), np.uint8))
    os.replace(str(not_zip) + ".npy", not_zip)
    for path in (empty, garbage, bad_png, cut_png, not_zip):
        with pytest.raises(UnreadableMediaError) as caught:
            read_media(path)
        assert caught.value.path == str(path)
