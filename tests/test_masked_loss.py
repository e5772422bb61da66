"""Issue 22 item 2: the masked loss (docs/masks.md). A mask's black part carries exactly no gradient and the LoRA
learns only what lies in its white part; black masks, mask folders and peers' mask keys behave as documented."""
import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.dataLoader.DiskCache import DiskCache
from modules.dataLoader.concept_scan import scan_concepts
from modules.dataLoader.pipeline.EncodeMask import EncodeMask, pool_to_latent
from modules.trainer.GenericTrainer import GenericTrainer
from modules.util.config.DataConfig import ConceptConfig
from modules.util.config.config_io import ConfigError, load_config
from modules.trainer.prepare import prepare_config
from modules.util.demo_assets import square_clip
from modules.util.video_frames import write_video

SIZE, FRAMES = 32, 9
STEPS = 60


def half_mask(path: Path, white: str = "right") -> Path:
    """A mask image, black on one half (x < 16 or x >= 16), white on the other."""
    mask = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
    if white == "right":
        mask[:, SIZE // 2:] = 255
    else:
        mask[:, :SIZE // 2] = 255
    Image.fromarray(mask).save(path)
    return path


def masked_dataset(folder: Path, count: int = 4, masks: bool = True) -> Path:
    """Clips whose right half holds a red square moving right and whose left half is plain green; with `masks`,
    each has `<stem>_mask.png` beside it, white on the right half."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        clip = np.zeros((FRAMES, SIZE, SIZE, 3), dtype=np.uint8)
        clip[:, :, SIZE // 2:] = square_clip((220, 40, 40), "right", FRAMES, SIZE, offset=i, square=8)[:, :, SIZE // 2:]
        clip[:, :, :SIZE // 2] = (40, 200, 60)
        write_video(folder / f"clip_{i}.mp4", clip, 16)
        (folder / f"clip_{i}.txt").write_text("a red square moving right\n")
        if masks:
            half_mask(folder / f"clip_{i}_mask.png")
    return folder


def trainer_for(tmp_path, base_model, dataset, *values) -> GenericTrainer:
    config = load_config(overrides=[
        f"model.base_model_name={base_model}", f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}",
        f"output.destination={tmp_path / 'out.safetensors'}", "output.dtype=FLOAT_32", "device=cpu",
        "train_dtype=FLOAT_32", "gradient_checkpointing=false", "batch_size=4", f'data.concepts=[{{"path": "{dataset}"}}]',
        "data.frame_buckets=[9]", "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0",
        "tensorboard=false", "timestep.distribution=uniform", *values])
    trainer = GenericTrainer(config, e2v_datasets=prepare_config(config))
    trainer._load()
    trainer._cache()
    return trainer


def test_pooling_follows_the_vae_compression():
    mask = torch.zeros(9, 16, 16)
    mask[0, :8, :8] = 1          # frame 0: its own latent frame
    mask[1:5, :, 8:] = 1         # frames 1..4: latent frame 1
    mask[5:7] = 1                # half of frames 5..8: latent frame 2 at 0.5
    pooled = pool_to_latent(mask, 8, 4)
    assert pooled.shape == (1, 3, 2, 2)
    assert pooled[0, 0].tolist() == [[1, 0], [0, 0]]
    assert pooled[0, 1].tolist() == [[0, 1], [0, 1]]
    assert pooled[0, 2].tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_black_half_has_exactly_zero_gradient(tmp_path, tiny_model):
    dataset = masked_dataset(tmp_path / "data")
    trainer = trainer_for(tmp_path, tiny_model("wan2.1-t2v"), dataset)
    batch = next(trainer.data.batches(0))
    weights = batch["mask_weight"]
    assert weights.shape == (4, 1, 3, 4, 4)  # 9 frames -> 3 latent frames, 32 px -> 4 latent columns
    assert torch.all(weights[..., :2] == 0) and torch.all(weights[..., 2:] == 1)
    prediction = trainer.setup.predict(batch, torch.Generator().manual_seed(0))
    predicted = prediction.predicted.detach().requires_grad_()
    loss = trainer.setup.calculate_loss(batch, dataclasses.replace(prediction, predicted=predicted))
    loss.backward()
    assert torch.all(predicted.grad[..., :2] == 0)          # exactly: the black half adds nothing
    assert torch.all(predicted.grad[..., 2:].abs().sum((0, 1, 2)) > 0)
    # the weighted mean over the mask's weight: the right half's plain mean
    error = (prediction.predicted - prediction.target) ** 2
    assert torch.allclose(loss, error[..., 2:].flatten(1).mean(1).mean(), rtol=1e-6)
    # loss.mask_min_weight keeps some weight outside the mask
    trainer.config.loss.mask_min_weight = 0.25
    predicted.grad = None
    again = trainer.setup.predict(batch, torch.Generator().manual_seed(0))
    trainer.setup.calculate_loss(batch, dataclasses.replace(again, predicted=predicted)).backward()
    # d/dp of sum(w (p - t)^2) / sum(w) is 2 w (p - t) / sum(w): per unit of 2 (p - t), 0.25 / W left, 1 / W right
    per_error = predicted.grad / (2 * (predicted.detach() - again.target)) * 4  # the batch mean divides by 4
    total = (0.25 * 2 + 2) / 4 * error[0].numel()  # sum(w) per item: half the columns at 0.25, half at 1
    assert torch.allclose(per_error[..., :2], torch.full_like(per_error[..., :2], 0.25 / total), rtol=1e-4)
    assert torch.allclose(per_error[..., 2:], torch.full_like(per_error[..., 2:], 1 / total), rtol=1e-4)


@torch.no_grad()
def half_errors(trainer, batch) -> dict[str, float]:
    """Per half (left = black, right = white): the squared error of the LoRA's and the base model's prediction to
    the training target, and the LoRA's effect (mean |LoRA - base|), over fixed sigmas and noise."""
    transformer = trainer.model.transformer
    transformer.eval()
    sums = {key: 0.0 for key in ("lora_left", "lora_right", "base_left", "base_right", "effect_left", "effect_right")}
    for k, sigma in enumerate((0.3, 0.5, 0.7, 0.9)):
        sigmas = torch.full((batch["latents"].shape[0],), sigma)
        lora = trainer.setup.predict(batch, torch.Generator().manual_seed(k), sigmas=sigmas)
        transformer.disable_adapters()
        base = trainer.setup.predict(batch, torch.Generator().manual_seed(k), sigmas=sigmas)
        transformer.enable_adapters()
        for side, columns in (("left", slice(0, 2)), ("right", slice(2, 4))):
            sums[f"lora_{side}"] += ((lora.predicted - lora.target)[..., columns] ** 2).mean().item()
            sums[f"base_{side}"] += ((base.predicted - base.target)[..., columns] ** 2).mean().item()
            sums[f"effect_{side}"] += (lora.predicted - base.predicted)[..., columns].abs().mean().item()
    return sums


def test_training_learns_the_white_half_and_leaves_the_black_half(tmp_path, tiny_model):
    """The same clips trained with the mask and without (the control): the masked LoRA lowers the white half's
    error as the control does, while in the black half it stays near the base model where the control learns."""
    from learning import train
    drops = {}
    for masks in (True, False):
        run = tmp_path / ("masked" if masks else "control")
        trainer = train(run, tiny_model("wan2.1-t2v"), masked_dataset(run / "data", masks=masks), steps=STEPS,
                        overrides=["optimizer.learning_rate=0.002", "lora.rank=8"])
        errors = half_errors(trainer, next(trainer.data.batches(0)))
        drops[masks] = {side: 1 - errors[f"lora_{side}"] / errors[f"base_{side}"] for side in ("left", "right")}
    # measured: masked left 0.09, right 0.29; control left 0.25, right 0.23 (error drops relative to the base)
    assert drops[True]["right"] > 0.2 and drops[False]["left"] > 0.2
    assert drops[True]["left"] < 0.6 * drops[False]["left"]
    assert drops[True]["left"] < 0.6 * drops[True]["right"]


def test_masks_are_found_and_a_black_one_skips_its_item(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    masks = tmp_path / "masks"
    masks.mkdir()
    clip = square_clip((220, 40, 40), "right", FRAMES, SIZE, offset=0)
    for stem in ("beside", "in_folder", "default", "black"):
        write_video(data / f"{stem}.mp4", clip, 16)
        (data / f"{stem}.txt").write_text("a red square\n")
    half_mask(data / "beside_mask.png")
    half_mask(masks / "in_folder.jpg", white="left")  # diffusion-pipe: the same name, any extension
    Image.fromarray(np.zeros((SIZE, SIZE, 3), dtype=np.uint8)).save(masks / "black.png")
    default = half_mask(tmp_path / "default.png")
    with caplog.at_level(logging.WARNING):
        result = scan_concepts([ConceptConfig(path=str(data), mask_path=str(masks), default_mask=str(default))])
    masks_by_clip = {Path(r["path"]).stem: Path(r["mask"]) for r in result.records}
    # the mask beside a clip is not a clip of its own; the black one's item is skipped, warned once and counted
    assert masks_by_clip == {"beside": data / "beside_mask.png", "in_folder": masks / "in_folder.jpg",
                             "default": default}
    assert [(Path(path).name, "black everywhere" in reason) for path, reason in result.skipped] == [("black.mp4", True)]
    assert sum("black everywhere" in r.getMessage() for r in caplog.records) == 1


def test_diffusion_pipe_mask_path_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "masks").mkdir()
    half_mask(tmp_path / "everything.png")
    (tmp_path / "d.toml").write_text("resolutions = [32]\nframe_buckets = [1, 9]\n[[directory]]\npath = 'a'\n"
                                     "mask_path = 'a/masks'\ndefault_mask_file = 'everything.png'\n")
    config = load_config(overrides=["data.dataset_config=d.toml"])
    concept = config.data.concepts[-1]
    assert (concept.path, concept.mask_path, concept.default_mask) == ("a", "a/masks", "everything.png")
    (tmp_path / "m.toml").write_text('[general]\nresolution = 32\n[[datasets]]\nvideo_jsonl_file = "m.jsonl"\n')
    (tmp_path / "m.jsonl").write_text('{"video_path": "a/clip.mp4", "caption": "x", "mask_path": "everything.png"}\n')
    write_video(tmp_path / "a" / "clip.mp4", square_clip((220, 40, 40), "right", FRAMES, SIZE, offset=0), 16)
    musubi = load_config(overrides=["data.dataset_config=m.toml"])
    records = scan_concepts(musubi.data.concepts[-1:]).records
    assert [Path(r["mask"]).resolve() for r in records] == [(tmp_path / "everything.png").resolve()]
    # blissful-tuner (a musubi-tuner fork): mask_directory, require_mask; its alpha_mask is refused by name
    (tmp_path / "b").mkdir()
    for stem in ("masked", "bare"):
        write_video(tmp_path / "b" / f"{stem}.mp4", square_clip((220, 40, 40), "right", FRAMES, SIZE, offset=0), 16)
        (tmp_path / "b" / f"{stem}.txt").write_text("x\n")
    half_mask(tmp_path / "a" / "masks" / "masked.png")
    (tmp_path / "f.toml").write_text('[general]\nresolution = 32\n[[datasets]]\nvideo_directory = "b"\n'
                                     'mask_directory = "a/masks"\nrequire_mask = true\n')
    fork = load_config(overrides=["data.dataset_config=f.toml"]).data.concepts[-1]
    assert (fork.mask_path, fork.mask_required) == ("a/masks", True)
    result = scan_concepts([fork])
    assert [Path(r["path"]).name for r in result.records] == ["masked.mp4"]
    assert [(Path(p).name, r.startswith("no mask")) for p, r in result.skipped] == [("bare.mp4", True)]
    (tmp_path / "g.toml").write_text('[[datasets]]\nvideo_directory = "b"\nalpha_mask = true\n')
    with pytest.raises(ConfigError, match="alpha_mask: not supported here: masks from the images' alpha"):
        load_config(overrides=["data.dataset_config=g.toml"])
    # a refused feature written as off (blissful-tuner's template spells out `alpha_mask = false`; diffusion-pipe's
    # example documents `cache_shuffle_num = 0` as "keep the caption") asks for nothing: accepted
    (tmp_path / "h.toml").write_text('[[datasets]]\nvideo_directory = "b"\nmask_directory = "a/masks"\n'
                                     'alpha_mask = false\nrequire_mask = false\n')
    assert load_config(overrides=["data.dataset_config=h.toml"]).data.concepts[-1].mask_path == "a/masks"
    (tmp_path / "e.toml").write_text("resolutions = [32]\ncache_shuffle_num = 0\nshuffle_tags = false\n"
                                     "[[directory]]\npath = 'a'\nmask_path = 'a/masks'\ncaption_prefix = ''\n")
    assert load_config(overrides=["data.dataset_config=e.toml"]).data.concepts[-1].mask_path == "a/masks"


def test_mask_cache_follows_the_mask_file_and_the_crop(tmp_path):
    """The mask is cropped as the clip (a crop of a wider clip keeps the mask's place), and an edited mask file is
    read again (its identity is in the cache key) while an unchanged one is read from the cache."""
    from modules.dataLoader.pipeline.Pipeline import Pipeline
    from modules.dataLoader.pipeline.ListSource import ListSource
    from modules.dataLoader.pipeline.ProbeMedia import ProbeMedia
    from modules.dataLoader.pipeline.FrameWindow import FrameWindow
    from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
    from modules.dataLoader.pipeline.LoadVideo import LoadVideo
    from modules.dataLoader.pipeline.ResizeCropVideo import ResizeCropVideo
    wide = np.zeros((FRAMES, SIZE, 2 * SIZE, 3), dtype=np.uint8)
    write_video(tmp_path / "wide.mp4", wide, 16)
    mask = np.zeros((SIZE // 2, SIZE, 3), dtype=np.uint8)  # half the clip's size: scaled to it first
    mask[:, 16:24] = 255   # the clip's columns 32..47: the centre crop's columns 16..31
    Image.fromarray(mask).save(tmp_path / "mask.png")
    concept = ConceptConfig(path=str(tmp_path))
    encoder = EncodeMask(DiskCache(tmp_path / "cache", "masks"), 8, 4)

    def pooled():
        pipeline = Pipeline([ListSource([{"path": str(tmp_path / "wide.mp4"), "concept": concept,
                                          "mask": str(tmp_path / "mask.png")}], ["path", "concept", "mask"]),
                             ProbeMedia(), FrameWindow([9], 16), ResolutionBucket(32, [1.0], unit=16), LoadVideo(),
                             ResizeCropVideo(), encoder], 0)
        pipeline.start_epoch(0)
        return pipeline.get_item(0)["mask_weight"]

    first = pooled()
    assert first.shape == (1, 3, 4, 4)
    assert torch.equal(first[0, 0], torch.tensor([[0, 0, 1, 1]] * 4, dtype=torch.float32))
    assert torch.equal(pooled(), first) and encoder.encode_calls == 1
    mask[:] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    os.utime(tmp_path / "mask.png", ns=(1, 10 ** 18))
    assert torch.equal(pooled(), torch.ones(1, 3, 4, 4)) and encoder.encode_calls == 2


def test_conditioned_frames_can_be_left_out_of_the_loss():
    from modules.modelSetup.loss_masks import mask_loss_weights
    from modules.util.config.LossConfig import LossConfig
    from modules.util.enum.WanVariant import WanVariant
    shape = (2, 16, 5, 4, 4)
    batch = {"condition": torch.zeros(2, 20, 5, 4, 4), "mask_weight": torch.ones(2, 1, 5, 4, 4)}
    assert torch.equal(mask_loss_weights(batch, LossConfig(), WanVariant.I2V, shape, torch.device("cpu")),
                       torch.ones(2, 1, 5, 4, 4))
    skip = LossConfig(skip_conditioned_frames=True)
    first = mask_loss_weights(batch, skip, WanVariant.I2V, shape, torch.device("cpu"))
    assert first[:, :, 0].sum() == 0 and torch.all(first[:, :, 1:] == 1)
    both = mask_loss_weights({"condition": batch["condition"]}, skip, WanVariant.FLF2V, shape, torch.device("cpu"))
    assert both.flatten().tolist() == [0, 1, 1, 1, 0]
    # text-to-video batches have no given frame: nothing is left out
    assert mask_loss_weights({}, skip, WanVariant.T2V, shape, torch.device("cpu")) is None


def test_mask_video_of_another_length_skips_its_clip_and_validation_uses_masks(tmp_path, tiny_model):
    dataset = masked_dataset(tmp_path / "data", count=8)
    # a mask video for clip_0 with 5 frames where the clip has 9: that clip cannot train (skipped, counted)
    (dataset / "clip_0_mask.png").unlink()
    write_video(dataset / "clip_0_mask.mp4", np.full((5, SIZE, SIZE, 3), 255, dtype=np.uint8), 16)
    trainer = trainer_for(tmp_path, tiny_model("wan2.1-t2v"), dataset, "data.validation_split=0.25")
    assert [(Path(p).name, "5" in r and "9" in r) for p, r in trainer.data.scan_result.skipped] == [("clip_0.mp4", True)]
    assert str(dataset / "clip_0.mp4") in trainer.data.failed
    assert "loss masks: 7 of 7 files" in trainer.data.report()
    # every other training clip trains (batches hold no paths: the items are counted)
    training = [r for r in trainer.data.scan_result.records if r["path"] != str(dataset / "clip_0.mp4")]
    assert sum(len(b["prompt"]) for b in trainer.data.batches(0)) == len(training) > 0
    validation = trainer.data.validation_pipeline(2)
    batch = validation.get_item(0)
    assert torch.all(batch["mask_weight"][..., :2] == 0) and torch.all(batch["mask_weight"][..., 2:] == 1)


def test_flf2v_given_frames_carry_no_gradient_with_the_mask(tmp_path, tiny_model):
    """loss.skip_conditioned_frames on a real FLF2V batch (condition and CLIP tokens cached): the first and last
    latent frames get exactly zero gradient, and the mask's black half still does in the frame between."""
    dataset = masked_dataset(tmp_path / "data")
    trainer = trainer_for(tmp_path, tiny_model("wan2.1-flf2v"), dataset, "loss.skip_conditioned_frames=true")
    batch = next(trainer.data.batches(0))
    assert "condition" in batch
    prediction = trainer.setup.predict(batch, torch.Generator().manual_seed(0))
    predicted = prediction.predicted.detach().requires_grad_()
    trainer.setup.calculate_loss(batch, dataclasses.replace(prediction, predicted=predicted)).backward()
    grad = predicted.grad  # (B, C, 3, 4, 4)
    assert torch.all(grad[:, :, 0] == 0) and torch.all(grad[:, :, 2] == 0) and torch.all(grad[..., :2] == 0)
    assert torch.all(grad[:, :, 1, :, 2:].abs().sum((0, 1)) > 0)


def test_mask_gamma_and_min_weight_shape_grey_weights():
    from modules.modelSetup.loss_masks import mask_loss_weights
    from modules.util.config.LossConfig import LossConfig
    from modules.util.enum.WanVariant import WanVariant
    grey = {"mask_weight": torch.tensor([0.0, 0.5, 1.0]).view(1, 1, 1, 1, 3)}

    def weights(**settings):
        return mask_loss_weights(grey, LossConfig(**settings), WanVariant.T2V, (1, 16, 1, 1, 3),
                                 torch.device("cpu")).flatten().tolist()
    assert weights() == [0.0, 0.5, 1.0]
    assert weights(mask_gamma=2.0) == [0.0, 0.25, 1.0]
    assert weights(mask_gamma=2.0, mask_min_weight=0.2) == pytest.approx([0.2, 0.4, 1.0])
