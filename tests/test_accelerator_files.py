"""The accelerator travels with the files: a LoRA trained with accelerated previews records the accelerator and its
schedule in its header, and `sample` with that LoRA stacks it by default (docs/distilled.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from test_accelerator import PROMPT, ROOT, _accelerator_parts, _write, load


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_lora_records_its_previews_accelerator_and_sample_stacks_it(tiny_model, squares_dataset, tmp_path):
    from learning import train
    base = tiny_model("wan2.1-t2v")
    accelerator = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(load(base).transformer, 5),
                         "lightx2v")
    train(tmp_path, base, squares_dataset, steps=1,
          overrides=[f'sampling.accelerator={{"file": "{accelerator}", "strength": 0.7, "steps": 3}}'])
    lora = tmp_path / "out.safetensors"
    with safe_open(str(lora), framework="pt") as f:
        recorded = json.loads(f.metadata()["wan_accelerator"])
    assert recorded == {"file": str(accelerator), "file_2": "", "strength": 0.7, "steps": 3,
                        "timesteps": [1000, 667, 334], "shift": 5.0}

    environment = {**os.environ, "OMP_NUM_THREADS": "1"}

    def sample(*extra: str) -> subprocess.CompletedProcess:
        out = tmp_path / f"out{len(extra)}"
        command = [sys.executable, str(ROOT / "scripts" / "sample.py"), "--lora", str(lora), "--prompt", PROMPT,
                   "--width", "32", "--height", "32", "--frames", "5", "--seed", "3", "--output-dir", str(out),
                   "--device", "cpu", *extra]
        result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment)
        assert result.returncode == 0, result.stderr
        return result

    stacked = sample()
    video = Path(stacked.stdout.splitlines()[0])
    record = json.loads(video.with_suffix(".json").read_text())
    assert record["steps"] == 3 and record["guidance"] == 1.0
    assert record["accelerator"] == {**recorded, "guidance": 1.0}
    assert f"accelerator {accelerator}" in stacked.stderr and "--no-accelerator" in stacked.stderr

    plain = sample("--no-accelerator", "--steps", "2")
    assert not Path(plain.stdout.splitlines()[0]).with_suffix(".json").exists()
    assert "accelerator" not in plain.stderr

    accelerator.rename(tmp_path / "moved.safetensors")
    missing = sample("--steps", "2")
    assert not Path(missing.stdout.splitlines()[0]).with_suffix(".json").exists()
    assert f"{accelerator}, which is not on this machine" in missing.stderr
