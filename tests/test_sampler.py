"""WanModelSampler, sample definitions, training previews and scripts/sample.py on tiny models.

"It matches" (DESIGN.md section 8): our sampler, built on diffusers' pipelines assembled from the live parts, gives
the frames that diffusers' own pipeline loaded independently from the same folder gives (same weights, seed and
settings), for every variant; with a LoRA file, our loader's output equals diffusers' `load_lora_weights`.
"""
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from PIL import Image

from modules.model.WanModel import WanModel
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.TrainingSampler import TrainingSampler, frame_strip, prompt_slug
from modules.modelSampler.sampling_io import apply_lora_files, parse_lora_argument
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler, round_frames, round_to_multiple
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import WAN_DEFAULT_NEGATIVE_PROMPT, SampleConfig
from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import LoraModule, expert_lora_paths, save_lora_file
from modules.util.sample_definitions import (SampleDefinitionError, load_sample_definitions, parse_prompt_line,
                                             save_samples_json)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a red square moving left"
ATOL = 2e-5

# variant -> (side, frames, first image, last image)
CASES = {
    "wan2.1-t2v": (32, 5, False, False),
    "wan2.1-i2v": (32, 5, True, False),
    "wan2.1-flf2v": (32, 5, True, True),
    "wan2.2-ti2v-5b": (64, 5, False, False),
    "wan2.2-t2v-a14b": (32, 5, False, False),
    "wan2.2-i2v-a14b": (32, 5, True, False),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and when other processes share the 2 CPU cores, OpenMP's
    spinning threads make this file several times slower; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for name in ("first", "last"):
        pixels = (rng.random((40, 48, 3)) * 255).astype(np.uint8)
        pixels[8:24, 8:24] = (220, 30, 30) if name == "first" else (30, 30, 220)
        Image.fromarray(pixels).save(folder / f"{name}.png")
        paths.append(folder / f"{name}.png")
    return paths[0], paths[1]


def load(folder: Path) -> WanModel:
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def reference_frames(pipeline, sample: SampleConfig) -> np.ndarray:
    """diffusers' own pipeline call with the sample's settings (images pre-cropped exactly as our sampler crops)."""
    pipeline.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=sample.prompt, negative_prompt=sample.effective_negative_prompt, height=sample.height,
                  width=sample.width, num_frames=sample.frames, num_inference_steps=sample.steps,
                  guidance_scale=sample.guidance, generator=torch.Generator().manual_seed(sample.seed))
    if sample.image:
        kwargs["image"] = WanModelSampler._load_image(sample.image, sample.height, sample.width)
    if sample.last_image:
        kwargs["last_image"] = WanModelSampler._load_image(sample.last_image, sample.height, sample.width)
    return pipeline(**kwargs).frames[0]


def sample_for(variant: str, images, **overrides) -> SampleConfig:
    side, frames, image, last = CASES[variant]
    # 2 steps: UniPC's timesteps 999, 500 put one step on each side of the A14B boundaries (875, 900)
    values = dict(prompt=PROMPT, width=side, height=side, frames=frames, steps=2, guidance=4.0, seed=7)
    if image:
        values["image"] = str(images[0])
    if last:
        values["last_image"] = str(images[1])
    values.update(overrides)
    return SampleConfig(**values)


# ------------------------------------------------------------------------------------------------ it matches

@pytest.mark.parametrize("variant", list(CASES))
def test_matches_diffusers_pipeline(variant, tiny_model, images):
    from diffusers import DiffusionPipeline

    folder = tiny_model(variant)
    model = load(folder)
    sample = sample_for(variant, images)
    ours = WanModelSampler(model).sample(sample)
    reference = reference_frames(DiffusionPipeline.from_pretrained(folder), sample)
    assert ours.frames.shape == reference.shape == (sample.frames, sample.height, sample.width, 3)
    assert ours.frames.std() > 0.01  # not a flat image
    np.testing.assert_allclose(ours.frames, reference, atol=ATOL, rtol=0)
    assert ours.fps == model.variant.native_fps


def test_ti2v_image_to_video_matches(tiny_model, images):
    from diffusers import WanImageToVideoPipeline

    folder = tiny_model("wan2.2-ti2v-5b")
    sample = sample_for("wan2.2-ti2v-5b", images, image=str(images[0]))
    ours = WanModelSampler(load(folder)).sample(sample)
    reference = reference_frames(WanImageToVideoPipeline.from_pretrained(folder), sample)
    np.testing.assert_allclose(ours.frames, reference, atol=ATOL, rtol=0)
    text_only = WanModelSampler(load(folder)).sample(sample_for("wan2.2-ti2v-5b", images))
    assert np.abs(text_only.frames - ours.frames).max() > 0.01  # the image conditions the video


def test_a14b_second_guidance_and_euler(tiny_model, images):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    folder = tiny_model("wan2.2-t2v-a14b")
    model = load(folder)
    sample = sample_for("wan2.2-t2v-a14b", images, guidance_2=2.0, scheduler="EULER", flow_shift=5.0, steps=3)
    ours = WanModelSampler(model).sample(sample)
    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    pipeline.set_progress_bar_config(disable=True)
    reference = pipeline(prompt=PROMPT, negative_prompt=WAN_DEFAULT_NEGATIVE_PROMPT, height=32, width=32,
                         num_frames=5, num_inference_steps=3, guidance_scale=4.0, guidance_scale_2=2.0,
                         generator=torch.Generator().manual_seed(7)).frames[0]
    np.testing.assert_allclose(ours.frames, reference, atol=ATOL, rtol=0)
    assert model.noise_scheduler.config.flow_shift == 3.0  # the model's scheduler is never touched


def _random_lora(transformer, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks.") and (".attn" in name or ".ffn" in name):
            weights[name] = LoraModule(down=torch.randn(4, module.in_features, generator=generator) * 0.3,
                                       up=torch.randn(module.out_features, 4, generator=generator) * 0.3, alpha=2.0)
    return weights


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-t2v-a14b"])
def test_lora_matches_diffusers_load_lora_weights(variant, tiny_model, images, tmp_path):
    from diffusers import DiffusionPipeline

    folder = tiny_model(variant)
    model = load(folder)
    sample = sample_for(variant, images)
    plain = WanModelSampler(model).sample(sample).frames
    if model.variant.has_two_experts:
        path = tmp_path / "lora.safetensors"
        high, low = expert_lora_paths(path)
        save_lora_file(_random_lora(model.transformer, 1), ModelFormat.COMFY_LORA, high)
        save_lora_file(_random_lora(model.transformer_2, 2), ModelFormat.COMFY_LORA, low)
    else:
        path = high = tmp_path / "lora.safetensors"
        save_lora_file(_random_lora(model.transformer, 1), ModelFormat.COMFY_LORA, path)
    applied = apply_lora_files(model, [(path, 0.7)])
    assert len(applied) == (2 if model.variant.has_two_experts else 1)
    ours = WanModelSampler(model).sample(sample).frames
    assert np.abs(ours - plain).max() > 0.01  # the LoRA changes the video

    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.load_lora_weights(str(high), adapter_name="high")
    names, strengths = ["high"], [0.7]
    if model.variant.has_two_experts:
        pipeline.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True)
        pipeline.transformer_2.set_adapters(["low"], [0.7])
    pipeline.transformer.set_adapters(names, strengths)
    np.testing.assert_allclose(ours, reference_frames(pipeline, sample), atol=1e-4, rtol=0)


def test_lora_argument_and_missing_file(tiny_model, tmp_path):
    assert parse_lora_argument("a/b.safetensors:0.5") == (Path("a/b.safetensors"), 0.5)
    assert parse_lora_argument("C:/x/b.safetensors") == (Path("C:/x/b.safetensors"), 1.0)
    assert parse_lora_argument("b.safetensors") == (Path("b.safetensors"), 1.0)
    model = load(tiny_model("wan2.1-t2v"))
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        apply_lora_files(model, [(tmp_path / "nope.safetensors", 1.0)])


# ------------------------------------------------------------------------------------------------ settings

def test_rounding_with_note(tiny_model, images, caplog):
    assert round_to_multiple(40, 16) == 48 and round_to_multiple(30, 16) == 32 and round_to_multiple(3, 16) == 16
    assert [round_frames(f) for f in (1, 2, 4, 6, 80, 81, 83)] == [1, 1, 5, 5, 81, 81, 85]
    sampler = WanModelSampler(load(tiny_model("wan2.1-t2v")))
    with caplog.at_level(logging.WARNING):
        result = sampler.sample(SampleConfig(prompt=PROMPT, width=40, height=30, frames=6, steps=1))
    assert result.frames.shape == (5, 32, 48, 3)
    assert (result.sample.width, result.sample.height, result.sample.frames) == (48, 32, 5)
    assert any("40x30 rounded to 48x32" in note for note in result.notes)
    assert any("frames 6 rounded to 5" in note for note in result.notes)
    assert "rounded to 48x32" in caplog.text
    # TI2V-5B: sides in units of 32
    resolved, notes = WanModelSampler(load(tiny_model("wan2.2-ti2v-5b"))).resolve(SampleConfig(width=80, height=64))
    assert (resolved.width, resolved.height) == (96, 64) and len(notes) == 1


def test_image_errors(tiny_model, images, tmp_path):
    i2v = WanModelSampler(load(tiny_model("wan2.1-i2v")))
    missing = tmp_path / "no such image.png"
    with pytest.raises(SampleError, match="no such image.png"):
        i2v.resolve(SampleConfig(prompt=PROMPT, image=str(missing)))
    with pytest.raises(SampleError, match="needs a first frame"):
        i2v.resolve(SampleConfig(prompt=PROMPT))
    with pytest.raises(SampleError, match="takes no last frame"):
        i2v.resolve(SampleConfig(prompt=PROMPT, image=str(images[0]), last_image=str(images[1])))
    t2v = WanModelSampler(load(tiny_model("wan2.1-t2v")))
    with pytest.raises(SampleError, match="takes no image"):
        t2v.resolve(SampleConfig(prompt=PROMPT, image=str(images[0])))
    with pytest.raises(SampleError, match="E2V"):
        t2v.resolve(SampleConfig(prompt=PROMPT, elements={"person": str(images[0])}))


def test_default_negative_prompt_and_defaults():
    sample = SampleConfig(prompt="x")
    assert sample.effective_negative_prompt == WAN_DEFAULT_NEGATIVE_PROMPT
    assert SampleConfig(prompt="x", negative_prompt="ugly").effective_negative_prompt == "ugly"
    merged = SampleConfig(prompt="x", steps=7).with_defaults(steps=30, guidance=3.0, seed=None)
    assert (merged.steps, merged.guidance, merged.seed) == (7, 3.0, 42)
    with pytest.raises(ValueError):
        SampleConfig(prompt="x", unknown_key=1)
    assert SampleConfig(scheduler="euler").scheduler == "EULER"


# ------------------------------------------------------------------------------------------------ definitions

def test_prompt_line_equals_json_form(tmp_path):
    line = ("a red square moving left --w 832 --h 480 --f 81 --s 30 --g 5.0 --d 42 --fs 3.0 "
            "--n blurry, static --i first.png --ei last.png")
    as_json = {"prompt": "a red square moving left", "width": 832, "height": 480, "frames": 81, "steps": 30,
               "guidance": 5.0, "seed": 42, "flow_shift": 3.0, "negative_prompt": "blurry, static",
               "image": "first.png", "last_image": "last.png"}
    assert parse_prompt_line(line) == SampleConfig(**as_json)
    (tmp_path / "prompts.txt").write_text(f"# previews\n\n{line}\nsecond one --l 3.5 --S 4\n", encoding="utf-8")
    (tmp_path / "samples.json").write_text(json.dumps([as_json, {"prompt": "off", "enabled": False}]),
                                           encoding="utf-8")
    from_text = load_sample_definitions(tmp_path / "prompts.txt")
    from_json = load_sample_definitions(tmp_path / "samples.json")
    assert from_text[0] == from_json[0]
    assert (from_text[1].prompt, from_text[1].guidance, from_text[1].steps) == ("second one", 3.5, 4)
    assert [s.enabled for s in from_json] == [True, False]
    # detected by content when the extension says nothing; round trip through save_samples_json
    save_samples_json(from_json, tmp_path / "samples.cfg")
    assert load_sample_definitions(tmp_path / "samples.cfg") == from_json
    # a relative image that exists beside the samples file is resolved against it
    Image.new("RGB", (8, 8)).save(tmp_path / "first.png")
    assert load_sample_definitions(tmp_path / "prompts.txt")[0].image == str(tmp_path / "first.png")


def test_prompt_line_errors(tmp_path, caplog):
    with pytest.raises(SampleDefinitionError, match="--zz"):
        parse_prompt_line("x --zz 3")
    with pytest.raises(SampleDefinitionError, match="--w"):
        parse_prompt_line("x --w wide")
    with caplog.at_level(logging.WARNING):
        assert parse_prompt_line("x --ci control.png").prompt == "x"
    assert "ignored" in caplog.text
    assert parse_prompt_line("x --cn control.mp4").control_video == "control.mp4"   # musubi-tuner's control video
    (tmp_path / "bad.json").write_text('[{"prompt": "x", "widht": 3}]', encoding="utf-8")
    with pytest.raises(SampleDefinitionError, match="widht"):
        load_sample_definitions(tmp_path / "bad.json")
    with pytest.raises(SampleDefinitionError, match="missing.txt"):
        load_sample_definitions(tmp_path / "missing.txt")


# ------------------------------------------------------------------------------------------------ previews

class _Progress(SimpleNamespace):
    pass


def _snapshot(model: WanModel) -> dict:
    parts = model.parts()
    return {
        "modes": {(n, m): mod.training for n, p in parts.items() for m, mod in p.named_modules()},
        "grads": {(n, k): v.requires_grad for n, p in parts.items() for k, v in p.named_parameters()},
        "devices": {n: {t.device for t in p.parameters()} for n, p in parts.items()},
        "adapters": {(n, m): mod.disable_adapters for n, p in parts.items() for m, mod in p.named_modules()
                     if hasattr(mod, "disable_adapters") and hasattr(mod, "lora_A")},
        "checkpointing": {n: getattr(p, "gradient_checkpointing", None) for n, p in parts.items()},
        "weights": {(n, k): v.detach().clone() for n, p in parts.items() for k, v in p.named_parameters()
                    if "lora_" in k},
    }


def test_training_previews_leave_state_unchanged(tiny_model, tmp_path):
    from peft import LoraConfig
    from torch.utils.tensorboard import SummaryWriter

    model = load(tiny_model("wan2.1-t2v"))
    torch.manual_seed(0)   # the adapter's random weights, whatever tests ran before in this process
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=["to_v", "to_out.0", "net.2"],
                                             init_lora_weights=False), adapter_name="default")
    for name, parameter in model.transformer.named_parameters():
        parameter.requires_grad_("lora_" in name)
    model.transformer.enable_gradient_checkpointing()
    model.transformer.train()
    model.text_encoder.encoder.block[0].train()  # a part in a mixed state

    samples_file = tmp_path / "samples.txt"
    samples_file.write_text(f"{PROMPT} --w 48 --h 32 --f 5 --d 5\n"
                            f"a blue circle --w 32 --h 32 --f 5 --s 1\n", encoding="utf-8")
    # bfloat16 training: previews run each transformer forward under autocast, as training does
    config = TrainConfig(workspace_dir=str(tmp_path / "workspace"), train_dtype=DataType.BFLOAT_16)
    config.sampling.samples_file = str(samples_file)
    config.sampling.steps = 2
    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    trainer = SimpleNamespace(config=config, model=model, device=torch.device("cpu"),
                              progress=_Progress(global_step=12, epoch=3), hooks=SimpleNamespace(writer=writer))

    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    before = _snapshot(model)
    # adapters disabled from outside (e.g. a prior-preservation step): previews still show them
    model.transformer.disable_adapters()
    disabled = _snapshot(model)
    rng_before = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    sampler = TrainingSampler(trainer)
    assert sampler.validate() == []
    outputs = sampler.sample_all()
    writer.close()

    assert torch.equal(torch.get_rng_state(), rng_before[0])
    assert random.getstate() == rng_before[1]
    np_after = np.random.get_state()
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(np_after, rng_before[2]))
    after = _snapshot(model)
    for key in ("modes", "grads", "devices", "adapters", "checkpointing"):
        assert after[key] == disabled[key], key
    assert all(torch.equal(after["weights"][k], before["weights"][k]) for k in before["weights"])
    assert before["modes"][("transformer", "")] is True and before["checkpointing"]["transformer"] is True

    # files: <workspace>/samples/<index>-<slug>/<step>-<epoch>.mp4 and .png
    assert [o.video for o in outputs] == [
        tmp_path / "workspace" / "samples" / f"0-{prompt_slug(PROMPT)}" / "12-3.mp4",
        tmp_path / "workspace" / "samples" / "1-a-blue-circle" / "12-3.mp4"]
    with av.open(str(outputs[0].video)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.average_rate == 16
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    strip = np.asarray(Image.open(outputs[0].strip))
    assert strip.shape == (32, 3 * 48, 3)

    # the preview shows the adapter at its current weights (enabled, though disabled outside): the lossless PNG
    # strip holds exactly the frames the sampler makes with the adapter, not those of the plain model
    model.transformer.enable_adapters()
    first = sampler.load_samples()[0].sample
    with_adapter = WanModelSampler(model, autocast_dtype=torch.bfloat16).sample(first).frames_uint8()
    model.transformer.disable_adapters()
    plain = load(tiny_model("wan2.1-t2v"))
    without = WanModelSampler(plain, autocast_dtype=torch.bfloat16).sample(first).frames_uint8()
    assert np.array_equal(strip, frame_strip(with_adapter))
    assert np.abs(frame_strip(without).astype(int) - strip.astype(int)).max() > 20
    assert np.abs(np.stack(frames).astype(int) - with_adapter.astype(int)).mean() < 20  # through lossy H.264

    # TensorBoard: an image summary per sample whose bytes are an animated GIF
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()["images"]
    assert sorted(tags) == sorted(f"samples/{o.video.parent.name}" for o in outputs)
    image = events.Images(tags[0])[0]
    assert image.step == 12 and image.encoded_image_string[:6] in (b"GIF89a", b"GIF87a")
    gif = Image.open(__import__("io").BytesIO(image.encoded_image_string))
    assert getattr(gif, "n_frames", 1) == 5


def test_no_samples_file_and_strip():
    trainer = SimpleNamespace(config=TrainConfig(), model=None, device=torch.device("cpu"),
                              progress=_Progress(global_step=0, epoch=0), hooks=SimpleNamespace(writer=None))
    assert TrainingSampler(trainer).sample_all() == []
    frames = np.arange(5 * 2 * 3 * 3, dtype=np.uint8).reshape(5, 2, 3, 3)
    assert np.array_equal(frame_strip(frames), np.concatenate([frames[0], frames[2], frames[4]], axis=1))
    assert prompt_slug("  Ünïcode!!  ") == "n-code" and prompt_slug("!!!") == "sample"


# ------------------------------------------------------------------------------------------------ scripts/sample.py

def test_sample_script_with_lora(tiny_model, tmp_path, capsys):
    folder = tiny_model("wan2.2-t2v-a14b")
    model = load(folder)
    high, low = expert_lora_paths(tmp_path / "lora.safetensors")
    save_lora_file(_random_lora(model.transformer, 1), ModelFormat.KOHYA_LORA, high)
    save_lora_file(_random_lora(model.transformer_2, 2), ModelFormat.KOHYA_LORA, low)
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "scripts" / "sample.py"), "--base-model-name", str(folder),
               "--lora", f"{tmp_path / 'lora.safetensors'}:0.8", "--prompt", PROMPT, "--prompt", "a blue circle",
               "--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--seed", "3",
               "--num-videos", "2", "--output-dir", str(out), "--device", "cpu"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    printed = [Path(line) for line in result.stdout.splitlines()]
    assert printed == [out / f"000-{prompt_slug(PROMPT)}-s3.mp4", out / f"000-{prompt_slug(PROMPT)}-s4.mp4",
                       out / "001-a-blue-circle-s3.mp4", out / "001-a-blue-circle-s4.mp4"]
    assert all(path.is_file() for path in printed)
    with av.open(str(printed[0])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    assert "transformer_2" in result.stderr  # both experts got their file

    # errors (in-process, to spare a second interpreter start): a missing image is exit 1 naming the path, bad
    # arguments exit 2
    import importlib.util
    spec = importlib.util.spec_from_file_location("sample_script", ROOT / "scripts" / "sample.py")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert script.main(["--base-model-name", str(tiny_model("wan2.1-i2v")), "--prompt", "x", "--image",
                        str(tmp_path / "gone.png"), "--output-dir", str(out), "--device", "cpu"]) == 1
    assert "gone.png" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--base-model-name", str(folder)])  # neither --prompt nor --samples-file
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------------------ placement

def test_parts_move_to_the_device_only_while_used(tiny_model, images, monkeypatch):
    """The materialise / evict schedule, observed on the CPU: the text encoder, the VAE and the low-noise expert
    pretend to live on another device ("meta" here, never really moved), the high-noise expert is on the sampling
    device. Each part must be on the device whenever it computes, and back home otherwise."""
    import modules.modelSampler.Placement as sampler_module

    model = load(tiny_model("wan2.2-i2v-a14b"))
    away = torch.device("meta")
    offloaded = {id(model.text_encoder), id(model.vae), id(model.transformer_2)}
    monkeypatch.setattr(sampler_module, "_device_of",
                        lambda module: away if id(module) in offloaded else torch.device("cpu"))
    moves, placements = [], []

    def record_move(self, name, device):
        placements[:] = [self]
        moves.append((name, device.type))

    monkeypatch.setattr(sampler_module.Placement, "_move", record_move)
    seen = []

    def check(name):
        def hook(module, args):
            seen.append(name)
            assert placements and placements[0].location[name] == torch.device("cpu"), f"{name} computed away"
        return hook

    handles = [model.text_encoder.register_forward_pre_hook(check("text_encoder")),
               model.vae.encoder.register_forward_pre_hook(check("vae")),
               model.vae.decoder.register_forward_pre_hook(check("vae")),
               model.transformer_2.register_forward_pre_hook(check("transformer_2"))]
    try:
        WanModelSampler(model, device="cpu").sample(sample_for("wan2.2-i2v-a14b", images))
    finally:
        for handle in handles:
            handle.remove()
    assert {"text_encoder", "vae", "transformer_2"} <= set(seen)
    assert moves == [("text_encoder", "cpu"), ("text_encoder", "meta"),   # the prompts
                     ("vae", "cpu"),                                       # the image condition ...
                     ("vae", "meta"), ("transformer_2", "cpu"),            # ... then the low-noise stage
                     ("transformer_2", "meta"),
                     ("vae", "cpu"), ("vae", "meta")]                      # the decode
    assert all(location == placements[0].home[name] for name, location in placements[0].location.items())


def test_gif_is_scaled_down_and_animated():
    from modules.modelSampler.TrainingSampler import gif_bytes

    frames = np.zeros((3, 480, 832, 3), dtype=np.uint8)
    frames[1, :, :, 0] = 255
    frames[2, :, :, 2] = 255
    with Image.open(__import__("io").BytesIO(gif_bytes(frames, 16))) as gif:
        assert gif.size == (320, 185) and gif.n_frames == 3 and gif.info["duration"] in (60, 62, 63)
