"""Data benchmark: how fast the loader turns video files into training clips, and how fast a cached epoch runs.

Writes `clips` synthetic H.264 clips (a scrolling noise texture with a moving square, `source_seconds` at
`source_fps`, yuv420p, crf 18, through `video_frames.write_video`) with caption sidecars, then measures:

(a) bare:   PyAV decoding every frame of each file to an rgb24 numpy array (threaded decoder, nothing else) -
            the floor any loader pays;
(b) ours:   the loader's real item pipeline (`WanBaseDataLoader._item_modules()`: ProbeMedia, FrameWindow with
            the model's 16 fps resampling and head extraction of `frames` frames, ResolutionBucket set so that the
            bucket is exactly height x width, LoadVideo, ResizeCropVideo to a float tensor) run on a fresh
            pipeline per pass, so the probe is paid as in a first epoch; clips/s, output frames/s and the ratio
            ours / bare in clips/s;
(c) cached: a `WanBaseDataLoader` with a tiny random wan2.1-t2v model (`tiny_pipelines.make_tiny_model`; cheap
            encoders) fills its disk cache (timed, for information), runs one epoch to warm the probe, then
            `warm_epochs` more epochs are timed: items/s of an epoch that only reads the cache (the encoders'
            call count is checked to stay unchanged).

(b) is also broken down by stage (`measure_breakdown`: the same video_io calls, timed one by one).
(a) and (b) take the fastest of `repeats` passes; the files are in the page cache (just written).
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import av
import cv2
import numpy as np

from modules.benchmark.common import environment, format_table


@dataclass
class DataBenchConfig:
    clips: int = 4
    width: int = 832                    # the bucket
    height: int = 480
    frames: int = 81
    source_fps: float = 30.0
    source_seconds: float = 6.0
    source_width: int = 832
    source_height: int = 480
    threads: int = 0
    repeats: int = 2
    warm_epochs: int = 3
    loader: bool = True
    workdir: str | None = None
    seed: int = 0


# ------------------------------------------------------------------------------------------------ source clips

def synthetic_clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 (frames, height, width, 3): a smooth random texture scrolling diagonally, a square moving across it,
    a slow brightness drift. Texture and motion give the encoder real work (unlike flat colours)."""
    rng = np.random.default_rng(seed)
    margin = 4 * frames
    coarse = rng.integers(0, 256, size=((height + margin) // 8 + 1, (width + margin) // 8 + 1, 3), dtype=np.uint8)
    texture = cv2.resize(coarse, ((width + margin) // 8 * 8 + 8, (height + margin) // 8 * 8 + 8),
                         interpolation=cv2.INTER_CUBIC)
    fine = rng.integers(-12, 13, size=texture.shape, dtype=np.int16)
    texture = np.clip(texture.astype(np.int16) + fine, 0, 255).astype(np.uint8)
    side = max(8, min(height, width) // 5)
    colour = rng.integers(64, 256, size=3, dtype=np.uint8)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        dy, dx = (2 * t) % margin, (3 * t) % margin
        frame = texture[dy:dy + height, dx:dx + width]
        gain = 0.85 + 0.15 * math.sin(2 * math.pi * t / max(frames, 1))
        out[t] = (frame * gain).astype(np.uint8)
        x = int((width - side) * (0.5 + 0.5 * math.sin(2 * math.pi * t / frames)))
        y = int((height - side) * t / max(frames - 1, 1))
        out[t, y:y + side, x:x + side] = colour
    return out


def write_source_clips(folder: Path, cfg: DataBenchConfig, log=print) -> tuple[list[Path], float]:
    from modules.util.video_frames import write_video

    folder.mkdir(parents=True, exist_ok=True)
    count = max(1, round(cfg.source_seconds * cfg.source_fps))
    paths = []
    started = time.perf_counter()
    for i in range(cfg.clips):
        path = folder / f"clip{i:03d}.mp4"
        write_video(path, synthetic_clip(count, cfg.source_height, cfg.source_width, cfg.seed + i), cfg.source_fps)
        path.with_suffix(".txt").write_text(f"a square moving over a scrolling texture, clip {i}")
        paths.append(path)
    seconds = time.perf_counter() - started
    log(f"wrote {cfg.clips} clips of {count} frames {cfg.source_width}x{cfg.source_height} at {cfg.source_fps:g} fps "
        f"in {seconds:.1f} s")
    return paths, seconds


# ------------------------------------------------------------------------------------------------ (a) bare PyAV

def bare_decode(path: str | Path) -> int:
    """Decodes every frame of the file to rgb24 numpy arrays; returns the frame count."""
    count = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            frame.to_ndarray(format="rgb24")
            count += 1
    return count


def _map(function, items: list, threads: int) -> list:
    if threads <= 0:
        return [function(item) for item in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(function, items))


def measure_bare(paths: list[Path], cfg: DataBenchConfig) -> dict:
    passes = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        frames = sum(_map(bare_decode, paths, cfg.threads))
        passes.append(time.perf_counter() - start)
    seconds = min(passes)
    return {"seconds": seconds, "passes": passes, "clips": len(paths), "decoded_frames": frames,
            "clips_per_second": len(paths) / seconds, "decoded_frames_per_second": frames / seconds}


# ------------------------------------------------------------------------------------------------ (b) our pipeline

def _bucket_resolution(width: int, height: int, unit: int = 16) -> int:
    """The data.resolution whose bucket for aspect width/height is exactly height x width."""
    from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket

    resolution = round(math.sqrt(width * height))
    if ResolutionBucket.make_buckets(resolution, [width / height], unit) != [(height, width)]:
        raise ValueError(f"{width}x{height} is not a reachable bucket (sides must be multiples of {unit})")
    return resolution


def _loader_config(clip_folder: Path, cache_dir: Path, cfg: DataBenchConfig):
    from modules.util.config.config_io import load_config

    return load_config(overrides=[
        f"data.concepts={json.dumps([{'path': str(clip_folder)}])}", f"cache_dir={cache_dir}",
        f"data.frame_buckets=[{cfg.frames}]", f"data.resolution={_bucket_resolution(cfg.width, cfg.height)}",
        f"data.aspect_ratios=[{cfg.width / cfg.height!r}]", f"data.dataloader_threads={cfg.threads}",
        "batch_size=1"])


def measure_ours(clip_folder: Path, cache_dir: Path, cfg: DataBenchConfig) -> dict:
    from modules.dataLoader.pipeline.Pipeline import Pipeline
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader

    loader = WanBaseDataLoader(_loader_config(clip_folder, cache_dir, cfg))
    loader.scan()
    passes = []
    for _ in range(cfg.repeats):
        # fresh modules each pass: ProbeMedia keeps its probes for its lifetime
        pipeline = Pipeline(loader._item_modules(), loader.config.seed, threads=cfg.threads,
                            outputs=["video", "frame_indices", "resolution_bucket"])
        start = time.perf_counter()
        pipeline.start_epoch(0)  # FrameWindow plans the windows from the probes: every file is probed here
        probed = time.perf_counter()
        items = decoded = output_frames = 0
        shapes = set()
        for item in pipeline.iterate(0):
            video = item["video"]
            shapes.add(tuple(video.shape))
            items += 1
            output_frames += video.shape[1]
            decoded += max(item["frame_indices"]) + 1   # decoded from the start up to the last frame used
        end = time.perf_counter()
        passes.append({"seconds": end - start, "probe_seconds": probed - start, "load_seconds": end - probed})
    best = min(passes, key=lambda p: p["seconds"])
    seconds = best["seconds"]
    if items == 0:
        raise RuntimeError("the pipeline produced no item (clips shorter than the frame bucket?)")
    return {**best, "passes": [p["seconds"] for p in passes], "clips": items, "output_frames": output_frames,
            "decoded_frames": decoded, "video_shapes": sorted(shapes), "clips_per_second": items / seconds,
            "output_frames_per_second": output_frames / seconds, "decoded_frames_per_second": decoded / seconds}


def measure_breakdown(paths: list[Path], cfg: DataBenchConfig) -> dict:
    """Where (b)'s time goes: the video_io calls the pipeline modules make, timed one by one (in the calling
    thread, one pass): probe_media, read_frames of the 16 fps head window, resize_and_crop, frames_to_tensor."""
    from modules.util.video_io import probe_media, read_frames
    from modules.util.video_frames import covering_size, frames_to_tensor, resize_and_crop

    stages = {"probe": 0.0, "decode": 0.0, "resize_crop": 0.0, "to_tensor": 0.0}
    for path in paths:
        start = time.perf_counter()
        info = probe_media(path)
        probed = time.perf_counter()
        indices = info.resample(16)[:cfg.frames]
        frames = read_frames(path, indices, info)
        decoded = time.perf_counter()
        scaled_h, scaled_w = covering_size(frames.shape[1], frames.shape[2], cfg.height, cfg.width)
        cropped = resize_and_crop(frames, cfg.height, cfg.width, (scaled_h - cfg.height) // 2,
                                  (scaled_w - cfg.width) // 2)
        resized = time.perf_counter()
        frames_to_tensor(cropped)
        done = time.perf_counter()
        stages["probe"] += probed - start
        stages["decode"] += decoded - probed
        stages["resize_crop"] += resized - decoded
        stages["to_tensor"] += done - resized
    return {"seconds": stages, "total_seconds": sum(stages.values()), "clips": len(paths)}


# ------------------------------------------------------------------------------------------------ (c) cached epoch

def measure_cached_epoch(clip_folder: Path, work: Path, cfg: DataBenchConfig, log=print) -> dict:
    import torch

    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    from modules.util.tiny_pipelines import make_tiny_model

    model_dir = make_tiny_model("wan2.1-t2v", work / "tiny-wan2.1-t2v")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(model_dir)))
    loader = WanBaseDataLoader(_loader_config(clip_folder, work / "cache", cfg))
    loader.scan()
    loader.attach_model(model, torch.device("cpu"))
    start = time.perf_counter()
    loader.cache()
    fill_seconds = time.perf_counter() - start
    calls = loader.encode_calls()
    log(f"cache filled in {fill_seconds:.1f} s ({calls} encoder calls)")
    first = sum(len(batch["prompt"]) for batch in loader.batches(0))   # warms the loader's own probes
    epochs = []
    items = 0
    shape = None
    for epoch in range(1, cfg.warm_epochs + 1):
        start = time.perf_counter()
        for batch in loader.batches(epoch):
            items += len(batch["prompt"])
            shape = tuple(batch["latents"].shape)
        epochs.append(time.perf_counter() - start)
    extra_calls = loader.encode_calls() - calls
    seconds = sum(epochs)
    return {"cache_fill_seconds": fill_seconds, "encoder_calls_filling": calls,
            "encoder_calls_warm": extra_calls, "items_first_epoch": first, "warm_epochs": len(epochs),
            "warm_epoch_seconds": epochs, "warm_items": items, "latent_batch_shape": shape,
            "items_per_second": items / seconds if seconds else None,
            "cache_bytes": sum(p.stat().st_size for p in (work / "cache").rglob("*") if p.is_file())}


# ------------------------------------------------------------------------------------------------ the benchmark

def run_data_benchmark(cfg: DataBenchConfig, log=print) -> dict:
    if cfg.clips < 1 or cfg.repeats < 1:
        raise ValueError("clips and repeats must be at least 1")
    if (cfg.frames - 1) % 4:
        raise ValueError(f"frames must be 4k+1, got {cfg.frames}")
    needed = (cfg.frames - 1) / 16 + 1 / 16
    if cfg.source_seconds < needed:
        raise ValueError(f"{cfg.frames} frames at 16 fps need source clips of at least {needed:.2f} s")
    _bucket_resolution(cfg.width, cfg.height)
    owned = cfg.workdir is None
    work = Path(tempfile.mkdtemp(prefix="wan-data-bench-")) if owned else Path(cfg.workdir)
    try:
        clip_folder = work / "clips"
        paths, write_seconds = write_source_clips(clip_folder, cfg, log)
        sizes = [p.stat().st_size for p in paths]
        result = {"config": asdict(cfg), "environment": environment(),
                  "source": {"clips": len(paths), "frames_per_clip": round(cfg.source_seconds * cfg.source_fps),
                             "size": [cfg.source_width, cfg.source_height], "fps": cfg.source_fps,
                             "mean_bytes": sum(sizes) / len(sizes),
                             "mean_mbit_per_second": sum(sizes) / len(sizes) * 8 / cfg.source_seconds / 1e6,
                             "write_seconds": write_seconds}}
        log("(a) bare PyAV decode ...")
        result["bare"] = measure_bare(paths, cfg)
        log("(b) our probe + decode + resample + resize/crop ...")
        result["ours"] = measure_ours(clip_folder, work / "cache-unused", cfg)
        result["ratio_ours_to_bare_clips_per_second"] = (result["ours"]["clips_per_second"]
                                                         / result["bare"]["clips_per_second"])
        result["breakdown"] = measure_breakdown(paths, cfg)
        if cfg.loader:
            log("(c) cached epoch through WanBaseDataLoader (tiny model) ...")
            result["cached"] = measure_cached_epoch(clip_folder, work, cfg, log)
        return result
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def data_table(result: dict) -> str:
    cfg, source = result["config"], result["source"]
    bare, ours = result["bare"], result["ours"]
    rows = [
        ["(a) bare PyAV decode, all frames -> rgb24", bare["clips_per_second"], bare["decoded_frames_per_second"],
         None, bare["seconds"], f"{bare['decoded_frames']} frames decoded"],
        ["(b) ours: probe + decode + 16 fps + resize/crop", ours["clips_per_second"],
         ours["decoded_frames_per_second"], ours["output_frames_per_second"], ours["seconds"],
         f"probe {ours['probe_seconds']:.3f} s; {ours['output_frames']} frames out of {ours['decoded_frames']} "
         f"decoded"],
    ]
    cached = result.get("cached")
    if cached:
        rows.append(["(c) warm cached epoch (WanBaseDataLoader)", cached["items_per_second"], None, None,
                     sum(cached["warm_epoch_seconds"]),
                     f"{cached['warm_items']} items in {cached['warm_epochs']} epochs, "
                     f"{cached['encoder_calls_warm']} encoder calls; cache fill {cached['cache_fill_seconds']:.1f} s"])
    table = format_table(["stage", "clips/s", "decoded fr/s", "output fr/s", "seconds", "note"], rows)
    head = (f"data benchmark: {source['clips']} clips of {source['frames_per_clip']} frames "
            f"{source['size'][0]}x{source['size'][1]} at {source['fps']:g} fps "
            f"({source['mean_mbit_per_second']:.1f} Mbit/s) -> {cfg['frames']} frames at 16 fps, bucket "
            f"{cfg['width']}x{cfg['height']}; threads {cfg['threads']}")
    ratio = f"ours / bare (clips/s): {result['ratio_ours_to_bare_clips_per_second']:.2f}"
    lines = [head, table, ratio]
    breakdown = result.get("breakdown")
    if breakdown:
        parts = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in breakdown["seconds"].items())
        lines.append(f"(b) by stage, one sequential pass over {breakdown['clips']} clips: {parts}")
    return "\n".join(lines)
