"""The stack check (docs/distilled.md, modules/modelSampler/stack_check.py): with `sampling.accelerator`, each preview
is also made at its own full steps and guidance without the accelerator, from the same seed, and the relative latent
distance of the two is printed, written to TensorBoard, the preview's JSON and the run report."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from modules.modelSampler.accelerator import load_accelerator
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.config.SampleConfig import SampleConfig
from test_accelerator import PROMPT, _accelerator_parts, _write, load

ROOT = Path(__file__).resolve().parent.parent
FOLDER = "0-a-red-square-moving-left"


def relative_rms(accelerated: torch.Tensor, full: torch.Tensor) -> float:
    """The documented definition, written out here rather than imported."""
    accelerated, full = accelerated.double(), full.double()
    return float(((accelerated - full) ** 2).mean().sqrt() / (full ** 2).mean().sqrt())


def _train(tmp_path, base, dataset, sample: dict, accelerator: dict, steps: int):
    from learning import train
    tmp_path.mkdir(parents=True, exist_ok=True)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": PROMPT, "width": 32, "height": 32, "frames": 5, "seed": 1, **sample}]))
    return train(tmp_path / "train", base, dataset, steps=steps,
                 overrides=["optimizer.learning_rate=0.01", "tensorboard=true", f"sampling.samples_file={samples}",
                            "sampling.every_n_steps=1", "sampling.sample_before_training=true",
                            f"sampling.accelerator={json.dumps(accelerator)}"])


def test_every_preview_records_its_stack_check(tiny_model, squares_dataset, tmp_path, capsys):
    base = tiny_model("wan2.1-t2v")
    path = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(load(base).transformer, 4), "lightx2v")
    trainer = _train(tmp_path, base, squares_dataset, {"steps": 2, "guidance": 4.0},
                     {"file": str(path), "strength": 0.8}, steps=2)
    out = capsys.readouterr().out
    folder = trainer.samples_dir / FOLDER

    # the preview JSON: one per preview (before training, after steps 1 and 2), each with its distance
    records = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in folder.glob("*.json")}
    assert sorted(records) == [0, 1, 2]
    distances = {step: record["stack_check"]["distance"] for step, record in records.items()}
    for record in records.values():
        assert record["steps"] == 4 and record["accelerator"]["strength"] == 0.8   # the preview is accelerated
        assert record["stack_check"]["full_steps"] == 2 and record["stack_check"]["full_guidance"] == 4.0
    assert all(0.01 < d < 10 for d in distances.values()), distances
    assert len(set(distances.values())) == 3   # the LoRA trains between previews: each check measures anew
    assert all((folder / f"{step}-0-full.mp4").is_file() for step in distances)   # the full-step sample, watchable

    # the run plan names the check and its cost; the printed preview line and the end report carry the distances
    plan = out[out.index("run plan:"):]
    assert "stack check: each accelerated preview is also made at its own steps" in plan
    assert "on top of the accelerator's 4" in plan
    for step, distance in distances.items():
        line = next(line for line in out.splitlines() if line.startswith(f"preview {FOLDER} at step {step}:"))
        assert f"stack check {distance:.4f} from the 2-step sample" in line, line
    report = out[out.index("run finished:"):]
    assert re.search(rf"{FOLDER}: step 0 {distances[0]:.4f}, step 1 {distances[1]:.4f}, step 2 {distances[2]:.4f}",
                     report), report

    # TensorBoard, read back
    events = EventAccumulator(str(trainer.tensorboard_dir))
    events.Reload()
    scalars = events.Scalars(f"stack_check/{FOLDER}")
    assert [s.step for s in scalars] == [0, 1, 2]
    assert [s.value for s in scalars] == pytest.approx([distances[s] for s in (0, 1, 2)], rel=1e-6)
    # the loss tab's graph reads them beside the loss (one sample: its distance is the mean drawn)
    from modules.ui.LossFollower import LossFollower, Source
    follower = LossFollower()
    follower._source = Source(Path(trainer.tensorboard_dir))   # read in this thread, not the follower's
    assert follower.read_now()
    curves = follower.snapshot.run.curves
    assert [step for step, _ in curves["stack check"]] == [0, 1, 2] and [s for s, _ in curves["loss"]] == [1, 2]
    assert [value for _, value in curves["stack check"]] == pytest.approx([distances[s] for s in (0, 1, 2)],
                                                                          rel=1e-6)

    # the same distance from the two sampler outputs computed here, on the model as the last preview saw it
    model = trainer.model
    sample = SampleConfig(prompt=PROMPT, width=32, height=32, frames=5, seed=1, steps=2, guidance=4.0)
    accelerator = load_accelerator(model, AcceleratorConfig(file=str(path), strength=0.8))
    accelerated = WanModelSampler(model, device="cpu", accelerator=accelerator).sample(sample)
    full = WanModelSampler(model, device="cpu").sample(sample)
    assert accelerated.sample.steps == 4 and full.sample.steps == 2
    assert distances[2] == pytest.approx(relative_rms(accelerated.latents, full.latents), rel=1e-5, abs=1e-7)


def test_an_accelerator_that_changes_nothing_measures_zero(tiny_model, squares_dataset, tmp_path):
    """Strength 0 on the very schedule the sample runs (Euler, shift 1, timesteps 1000 and 1, guidance 1): the two
    samples are the same computation from the same noise, so the check reads 0; strength 0.8 on that schedule does
    not. A full-step sample made from other noise than the preview's would read far from 0."""
    base = tiny_model("wan2.1-t2v")
    path = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(load(base).transformer, 4), "lightx2v")
    same_schedule = {"steps": 2, "guidance": 1.0, "scheduler": "EULER", "flow_shift": 1.0}
    readings = {}
    for strength in (0.0, 0.8):
        trainer = _train(tmp_path / str(strength), base, squares_dataset, same_schedule,
                         {"file": str(path), "strength": strength, "timesteps": [1000, 1], "shift": 1.0}, steps=1)
        readings[strength] = [json.loads(p.read_text())["stack_check"]["distance"]
                              for p in sorted((trainer.samples_dir / FOLDER).glob("*.json"))]
    assert readings[0.0] == [0.0, 0.0], readings
    assert all(d > 0.01 for d in readings[0.8]), readings


def test_an_unknown_distill_mode_stops_before_any_model_loads(tiny_model, squares_dataset, tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "train.py"),
               "--config-value", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
               "--config-value", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
               "--config-value", f"workspace_dir={tmp_path / 'run'}", "--config-value", "device=cpu"]
    other = subprocess.run(command + ["--config-value", "distill.mode=fast"], capture_output=True, text=True,
                           timeout=120)
    assert other.returncode == 2 and "distill.mode" in other.stderr and "allowed: 'base', 'preserve'" in other.stderr
    assert "run plan" not in other.stdout and not (tmp_path / "run").exists()
