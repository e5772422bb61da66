"""Our Animate sampler equals diffusers' WanAnimatePipeline for the same inputs, seed and steps (fp32, tiny model):
animate mode over two segments (the second continued from the first's last frames) and replace mode; bad inputs are
refused naming the field."""
import numpy as np
import pytest
import torch
from diffusers import WanAnimatePipeline
from PIL import Image

from modules.model import animate_condition as ac
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.video_frames import write_video
from modules.util.video_io import read_media

SIZE = 32


@pytest.fixture(scope="module")
def animate(tiny_model):
    folder = tiny_model("wan2.2-animate")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))
    pipe = WanAnimatePipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                              scheduler=model.noise_scheduler, image_processor=model.image_processor,
                              image_encoder=model.image_encoder, transformer=model.transformer)
    pipe.set_progress_bar_config(disable=True)
    return model, pipe


def _clip(path, seed: int, frames: int, size: int, mask: bool = False) -> list[Image.Image]:
    """Writes an MP4 and returns its frames as read back (what both sides are given)."""
    rng = np.random.default_rng(seed)
    if mask:
        video = np.zeros((frames, size, size, 3), np.uint8)
        video[:, size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    else:
        video = np.repeat(np.repeat(rng.integers(0, 256, (frames, size // 8, size // 8, 3), dtype=np.uint8),
                                    8, axis=1), 8, axis=2)
    write_video(path, video, 30)
    return [Image.fromarray(frame) for frame in read_media(path)]


@pytest.mark.parametrize("mode,frames,guidance", [("animate", 9, 1.0), ("replace", 5, 2.0)])
def test_sampler_equals_the_pipeline(animate, tmp_path, monkeypatch, mode, frames, guidance):
    model, pipe = animate
    # the video's size: of another size the pipeline resizes it with PIL's bilinear filter, our sampler as the
    # official code does, with OpenCV's INTER_LINEAR (test_official_conditioning.py); here neither resizes
    reference = Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    reference.save(tmp_path / "ref.png")
    pose = _clip(tmp_path / "pose.mp4", 1, frames, SIZE)
    face = _clip(tmp_path / "face.mp4", 2, frames, 16)
    extra, fields = {}, {}
    if mode == "replace":
        extra = dict(background_video=_clip(tmp_path / "bg.mp4", 3, frames, SIZE),
                     mask_video=_clip(tmp_path / "mask.mp4", 4, frames, SIZE, mask=True))
        fields = dict(background_video=str(tmp_path / "bg.mp4"), mask_video=str(tmp_path / "mask.mp4"))
    segment = 5   # animate: 9 frames = two segments of 5 overlapping by 1
    # the pipeline's CLIP tokens as the official code makes them (its own encode_image crops the original image)
    monkeypatch.setattr(pipe, "encode_image", lambda image, device=None: ac.clip_image_tokens(
        pipe.image_encoder, ac.reference_pixels(image, SIZE, SIZE)), raising=False)
    expected = pipe(image=reference, pose_video=pose, face_video=face, prompt="a person dancing",
                    negative_prompt="blurry", height=SIZE, width=SIZE, segment_frame_length=segment,
                    num_inference_steps=2, guidance_scale=guidance, mode=mode, prev_segment_conditioning_frames=1,
                    generator=torch.Generator().manual_seed(7), output_type="np", **extra).frames[0]
    sample = SampleConfig(prompt="a person dancing", negative_prompt="blurry", width=SIZE, height=SIZE,
                          frames=segment, steps=2, guidance=guidance, seed=7, reference_image=str(tmp_path / "ref.png"),
                          pose_video=str(tmp_path / "pose.mp4"), face_video=str(tmp_path / "face.mp4"),
                          animate_mode=mode, continuation_frames=1, **fields)
    result = WanModelSampler(model, device="cpu").sample(sample)
    assert result.frames.shape == expected.shape == (frames, SIZE, SIZE, 3)
    np.testing.assert_allclose(result.frames, expected, rtol=0, atol=1e-5)


def test_bad_animate_samples_are_named(animate, tmp_path):
    model, _ = animate
    sampler = WanModelSampler(model, device="cpu")
    with pytest.raises(SampleError, match="face_video is required"):
        sampler.resolve(SampleConfig(prompt="x", reference_image=__file__, pose_video=__file__))
    with pytest.raises(SampleError, match="background_video is required in replace mode"):
        sampler.resolve(SampleConfig(prompt="x", reference_image=__file__, pose_video=__file__,
                                     face_video=__file__, animate_mode="replace"))
    _clip(tmp_path / "pose.mp4", 1, 9, SIZE)
    _clip(tmp_path / "face.mp4", 2, 5, 16)
    Image.new("RGB", (SIZE, SIZE)).save(tmp_path / "ref.png")
    with pytest.raises(SampleError, match="face_video has 5 frames, the pose video 9"):
        sampler.sample(SampleConfig(prompt="x", width=SIZE, height=SIZE, frames=5, steps=1,
                                    reference_image=str(tmp_path / "ref.png"), pose_video=str(tmp_path / "pose.mp4"),
                                    face_video=str(tmp_path / "face.mp4")))


def test_animate_inputs_given_to_another_model_are_refused(tiny_model):
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    with pytest.raises(SampleError, match="not a Wan2.2-Animate model"):
        WanModelSampler(model, device="cpu").resolve(SampleConfig(prompt="x", pose_video="p.mp4"))


def test_sample_script_animates_a_long_pose_video_in_segments(tiny_model, tmp_path):
    from tests.wan_file_layouts import sample_tiny_video
    _clip(tmp_path / "pose.mp4", 1, 13, SIZE)   # 13 frames in segments of 5 overlapping by 1: 3 segments
    _clip(tmp_path / "face.mp4", 2, 13, 16)
    Image.new("RGB", (SIZE, SIZE), "red").save(tmp_path / "ref.png")
    assert sample_tiny_video(tiny_model("wan2.2-animate"), tmp_path / "out",
                             ["--reference-image", str(tmp_path / "ref.png"), "--pose-video",
                              str(tmp_path / "pose.mp4"), "--face-video", str(tmp_path / "face.mp4")]) == 13
