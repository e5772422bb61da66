"""The accelerator travels with the files: a LoRA trained with accelerated previews records the accelerator and its
schedule in its header, and `sample` with that LoRA stacks it by default (docs/distilled.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from test_accelerator import PROMPT, ROOT, _accelerator_parts, _write, load, one_thread  # noqa: F401 (autouse)


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


def test_compare_with_an_accelerator_runs_every_cell_on_its_schedule(tiny_model, tmp_path):
    import numpy as np
    from PIL import Image

    from modules.modelSampler.accelerator import load_accelerator
    from modules.modelSampler.compare_grid import HEADER_HEIGHT, LABEL_WIDTH
    from modules.modelSampler.sampling_io import apply_lora_files
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    from modules.util.config.SampleConfig import SampleConfig
    from modules.util.enum.ModelFormat import ModelFormat
    from modules.util.lora.formats import save_lora_file
    from test_compare import compare_script, random_lora

    folder = tiny_model("wan2.1-t2v")
    model = load(folder)
    accelerator = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(model.transformer, 6), "lightx2v")
    lora = tmp_path / "lora-step-100.safetensors"
    save_lora_file(random_lora(model.transformer, 1), ModelFormat.COMFY_LORA, lora)
    sample = {"prompt": PROMPT, "width": 32, "height": 32, "frames": 5, "steps": 20, "guidance": 5.0, "seed": 3}
    samples_file = tmp_path / "samples.json"
    samples_file.write_text(json.dumps([sample]))
    out = tmp_path / "compare"
    code = compare_script().main(["--base-model-name", str(folder), "--lora", str(lora), "--strengths", "0.5", "1.0",
                                  "--accelerator", f"{accelerator}:0.8", "--samples-file", str(samples_file),
                                  "--output-dir", str(out), "--device", "cpu"])
    assert code == 0
    layout = json.loads((out / "000-a-red-square-moving-left-s3.json").read_text())
    assert layout["steps"] == 4 and layout["guidance"] == 1.0 and layout["title"] == "4 steps, accelerated"
    assert layout["accelerator"]["file"] == str(accelerator) and layout["accelerator"]["strength"] == 0.8
    assert layout["accelerator"]["timesteps"] == [1000, 750, 500, 250]

    # the checkpoint's cell at 1.0 is sample.py's run: the LoRA merged, the accelerator on top
    apply_lora_files(model, [(lora, 1.0)])
    expected = WanModelSampler(model, device=torch.device("cpu"),
                               accelerator=load_accelerator(model, AcceleratorConfig(file=str(accelerator),
                                                                                     strength=0.8))
                               ).sample(SampleConfig(**sample)).frames
    sheet = np.asarray(Image.open(out / "000-a-red-square-moving-left-s3.png"))
    top, left, height, width = layout["cells"][1][1]
    scale = layout["scale"]
    frame = (expected[layout["middle_frame"]] * 255).round().clip(0, 255).astype(np.uint8)
    assert np.abs(sheet[top:top + height:scale, left:left + width:scale].astype(int) - frame).max() <= 1
    assert sheet[:HEADER_HEIGHT, :LABEL_WIDTH].max() > 200   # the corner says how the cells ran
