"""Our Animate-2 sampler equals diffusers' modular `WanAnimate2ModularPipeline` for the same inputs, seed and steps
(fp32, tiny model, a 30 fps driving video resampled to the model's 24 fps, of two segments: the second continued from
the first's last frame, the last one zigzag-padded and trimmed), with and without classifier-free guidance; bad inputs are refused naming the field."""
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.guiders import ClassifierFreeGuidance
from PIL import Image

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.tiny_animate import animate_2_modular_pipeline
from modules.util.video_frames import write_video
from modules.util.video_io import read_media

SIZE, SEGMENT, FRAMES = 32, 5, 7   # 7 frames in segments of 5 overlapping by 1: two segments, one frame padded
SOURCE_FRAMES, SOURCE_FPS = 9, 30  # the driving video as stored: 9 frames at 30 fps are 7 at the model's 24


@pytest.fixture(scope="module")
def animate_2(tiny_model, tmp_path_factory):
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate-2"))))
    folder = tmp_path_factory.mktemp("animate2-inputs")
    rng = np.random.default_rng(0)
    # a reference of another aspect ratio: the pipeline resolves the size from it and crops the bars off again
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(folder / "ref.png")
    video = np.repeat(np.repeat(rng.integers(0, 256, (SOURCE_FRAMES, SIZE // 8, SIZE // 8, 3), dtype=np.uint8), 8,
                                axis=1), 8, axis=2)
    write_video(folder / "driving.mp4", video, SOURCE_FPS)
    return model, folder


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_sampler_equals_the_modular_pipeline(animate_2, guidance):
    model, folder = animate_2
    pipe = animate_2_modular_pipeline(model, FlowMatchEulerDiscreteScheduler(shift=5.0))
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    driving = [Image.fromarray(frame) for frame in read_media(folder / "driving.mp4")]
    expected = pipe(image=Image.open(folder / "ref.png"), driving_video=driving, driving_video_fps=SOURCE_FPS,
                    prompt="a person dancing", negative_prompt="blurry", height=SIZE, width=SIZE, segment_frame_length=SEGMENT,
                    prev_segment_conditioning_frames=1, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(7), output="videos")[0]
    sample = SampleConfig(prompt="a person dancing", negative_prompt="blurry", width=SIZE, height=SIZE,
                          frames=SEGMENT, steps=2, guidance=guidance, seed=7, scheduler="EULER", flow_shift=5.0,
                          reference_image=str(folder / "ref.png"), driving_video=str(folder / "driving.mp4"),
                          continuation_frames=1)
    result = WanModelSampler(model, device="cpu").sample(sample)
    # 32 x 16: the area 32 x 32 at the 4:3 reference's aspect ratio (both sides multiples of 16)
    assert result.frames.shape == expected.shape == (FRAMES, 32, 16, 3)
    assert result.notes == ["16 x 32: the area of 32 x 32 at the reference image's aspect ratio, as the pipeline "
                            "sizes Animate-2's output"]
    np.testing.assert_allclose(result.frames, expected, rtol=0, atol=1e-5)


def test_bad_animate_2_samples_are_named(animate_2, tiny_model):
    model, folder = animate_2
    sampler = WanModelSampler(model, device="cpu")
    with pytest.raises(SampleError, match="driving_video is required for Wan2.2-Animate-2"):
        sampler.resolve(SampleConfig(prompt="x", reference_image=str(folder / "ref.png")))
    with pytest.raises(SampleError, match="reference_image is required.*pose_video: Wan2.2-Animate-2 takes"):
        sampler.resolve(SampleConfig(prompt="x", driving_video=str(folder / "driving.mp4"), pose_video="p.mp4"))
    with pytest.raises(SampleError, match="driving_video 'gone.mp4' does not exist"):
        sampler.resolve(SampleConfig(prompt="x", reference_image=str(folder / "ref.png"), driving_video="gone.mp4"))
    write_video(folder / "short.mp4", np.zeros((2, SIZE, SIZE, 3), np.uint8), 24)
    with pytest.raises(SampleError, match="2 frames at 24 fps, too few for segments of 5 frames"):
        sampler.sample(SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=SEGMENT, steps=1,
                                    reference_image=str(folder / "ref.png"), driving_video=str(folder / "short.mp4")))
    other = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    with pytest.raises(SampleError, match="driving_video: .* is not a Wan2.2-Animate model"):
        WanModelSampler(other, device="cpu").resolve(SampleConfig(prompt="x", driving_video="d.mp4"))


def test_sample_script_animates_a_long_driving_video_in_segments(animate_2, tiny_model, tmp_path):
    from tests.wan_file_layouts import sample_tiny_video
    _, folder = animate_2
    # 7 frames in segments of 5 overlapping by 1: two segments, trimmed back to the driving video's 7 frames
    assert sample_tiny_video(tiny_model("wan2.2-animate-2"), tmp_path / "out",
                             ["--reference-image", str(folder / "ref.png"), "--driving-video",
                              str(folder / "driving.mp4"), "--reference-prompt", "a dance", "--scheduler",
                              "euler"]) == FRAMES


@pytest.mark.parametrize("variant,flags,message", [
    ("wan2.2-animate-2", ["--reference-image", "ref.png"], "driving_video is required for Wan2.2-Animate-2"),
    ("wan2.2-animate-2", ["--reference-image", "ref.png", "--driving-video", "d.mp4", "--pose-video", "p.mp4"],
     "pose_video: Wan2.2-Animate-2 takes a driving video"),
    ("wan2.2-animate", ["--reference-image", "r.png", "--pose-video", "p.mp4", "--face-video", "f.mp4",
                        "--driving-video", "d.mp4"], "driving_video: Wan2.2-Animate takes a pose video"),
    ("wan2.1-t2v", ["--driving-video", "d.mp4"], "driving_video: T2V is not a Wan2.2-Animate model")])
def test_sample_script_refuses_misplaced_character_flags_before_loading(tiny_model, tmp_path, capsys, monkeypatch,
                                                                        variant, flags, message):
    from PIL import Image

    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from tests.script_loader import load_script

    def never(*_args, **_kwargs):
        raise AssertionError("weights loaded")
    monkeypatch.setattr(WanBaseModelLoader, "load", never)
    monkeypatch.chdir(tmp_path)   # the reference images exist (their files are checked first); the videos need not
    for name in ("ref.png", "r.png"):
        Image.new("RGB", (SIZE, SIZE)).save(name)
    script = load_script("sample")
    assert script.main(["--base-model-name", str(tiny_model(variant)), "--prompt", "x", "--device", "cpu",
                        "--output-dir", str(tmp_path), *flags]) == 1
    assert message in capsys.readouterr().err


def test_samples_file_driving_video_is_relative_to_the_file(tmp_path):
    import json

    from modules.util.sample_definitions import load_sample_definitions
    (tmp_path / "clips").mkdir()
    for name in ("me.png", "dance.mp4"):
        (tmp_path / "clips" / name).write_bytes(b"")
    (tmp_path / "samples.json").write_text(json.dumps([{"prompt": "x", "reference_image": "clips/me.png",
                                                        "driving_video": "clips/dance.mp4",
                                                        "reference_prompt": "a dance"}]), encoding="utf-8")
    [sample] = load_sample_definitions(tmp_path / "samples.json")
    assert sample.driving_video == str(tmp_path / "clips" / "dance.mp4")
    assert sample.reference_image == str(tmp_path / "clips" / "me.png") and sample.reference_prompt == "a dance"


def test_distilled_release_samples_with_its_own_defaults_as_its_pipeline(animate_2, tiny_model, tmp_path):
    """A folder of the distilled release (its model_index names WanAnimate2DistilledModularPipeline) samples, where
    the sample sets no steps or guidance, in its pipeline's 10 steps without guidance: what that pipeline makes."""
    import json
    _, folder = animate_2
    base = tiny_model("wan2.2-animate-2")
    distilled = tmp_path / "distilled"
    distilled.mkdir()
    for part in base.iterdir():
        if part.is_dir():
            (distilled / part.name).symlink_to(part)
    index = json.loads((base / "model_index.json").read_text(encoding="utf-8"))
    index["_class_name"] = "WanAnimate2DistilledModularPipeline"
    (distilled / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(distilled)))
    pipe = animate_2_modular_pipeline(model, FlowMatchEulerDiscreteScheduler(shift=5.0), distilled=True)
    driving = [Image.fromarray(frame) for frame in read_media(folder / "driving.mp4")]
    expected = pipe(image=Image.open(folder / "ref.png"), driving_video=driving, driving_video_fps=SOURCE_FPS,
                    prompt="a person dancing", height=SIZE, width=SIZE, segment_frame_length=SEGMENT, generator=torch.Generator().manual_seed(7),
                    output="videos")[0]
    sample = SampleConfig(prompt="a person dancing", width=SIZE, height=SIZE, frames=SEGMENT, seed=7,
                          scheduler="EULER", reference_image=str(folder / "ref.png"),
                          driving_video=str(folder / "driving.mp4"))
    sampler = WanModelSampler(model, device="cpu")
    resolved, _ = sampler.resolve(sample)
    assert (resolved.steps, resolved.guidance, resolved.flow_shift) == (10, 1.0, 5.0)
    np.testing.assert_allclose(sampler.sample(sample).frames, expected, rtol=0, atol=1e-5)


def test_a_distilled_animate_2_base_samples_on_its_own_pipeline(animate_2, tiny_model, tmp_path, capsys):
    """A base that says it is step-distilled (docs/distilled.md) but is an Animate-2 model keeps its own pipeline:
    the step-distill schedule does not apply to it, and sample says so instead of refusing."""
    import json
    import shutil

    from tests.wan_file_layouts import sample_tiny_video
    _, folder = animate_2
    base = tmp_path / "distilled"
    shutil.copytree(tiny_model("wan2.2-animate-2"), base)
    (base / "transformer" / "distill.json").write_text(json.dumps({"denoising_step_list": [1000, 750, 500, 250],
                                                                    "sample_shift": 5, "enable_cfg": False}))
    assert sample_tiny_video(base, tmp_path / "out", ["--reference-image", str(folder / "ref.png"),
                                                      "--driving-video", str(folder / "driving.mp4"),
                                                      "--scheduler", "euler"]) == FRAMES
    assert "the distilled base's schedule is not used" in capsys.readouterr().err
