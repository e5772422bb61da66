"""Previews over a sharded (FSDP2) model: every rank computes each preview in step with rank 0, so the ranks must
make the same forward passes. What that asks of TrainingSampler when a preview fails, in one process (the
collectives of one rank are the single-process case; tests/test_multi_gpu.py runs the 2-rank previews)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.TrainingSampler import PreviewOutOfStep, TrainingSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.TrainConfig import TrainConfig


def test_a_preview_in_step_is_skipped_before_it_starts_and_stops_the_run_when_it_fails_mid_way(tiny_model, tmp_path):
    """A preview that cannot start (a text-to-video model given an image) is skipped before any forward pass, and
    the next one is made; one that fails while it is computed (here: the text encoder gone) stops the run in step,
    where one process would skip it: the other ranks would be left waiting in a forward pass."""
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    image = tmp_path / "first.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(image)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "image": str(image), "width": 32, "height": 32,
                                    "frames": 5},
                                   {"prompt": "a blue circle", "width": 32, "height": 32, "frames": 5}]))
    config = TrainConfig(workspace_dir=str(tmp_path / "workspace"))
    config.sampling.samples_file = str(samples)
    config.sampling.steps = 2
    parallel = SimpleNamespace(forward_needs_every_rank=True)   # the flag ParallelLayout sets over sharded experts
    trainer = SimpleNamespace(config=config, model=model, device=torch.device("cpu"), parallel=parallel,
                              progress=SimpleNamespace(global_step=4, epoch=0), hooks=SimpleNamespace(writer=None))
    sampler = TrainingSampler(trainer)
    assert sampler.in_step
    outputs = sampler.sample_all()
    assert [output.index for output in outputs] == [1] and outputs[0].video.is_file()
    assert sampler.failures == 1
    assert not (tmp_path / "workspace" / "samples" / "0-a-red-square").exists()

    model.text_encoder = None
    with pytest.raises(PreviewOutOfStep, match="1-a-blue-circle failed on this rank"):
        sampler.sample_all()
    # one process (or DDP, where rank 0 samples alone) skips both and trains on
    parallel.forward_needs_every_rank = False
    alone = TrainingSampler(trainer)
    assert alone.sample_all() == [] and alone.failures == 2
