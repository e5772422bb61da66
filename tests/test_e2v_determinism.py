"""It resumes, for E2V: a run continues identically in a new process, whatever that process's PYTHONHASHSEED (str
hashes, and so the iteration order of sets of strings, change with it), and an E2V run killed mid-step resumes from
its backup to the bit-identical LoRA of the run that never stopped. The T2V base is expanded (image branch: its
add_v_proj starts at 0, so add_k_proj's initialisation shows only from step 2 on) and frame_conditioning is
random (a slot subset drawn per item and epoch)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from modules.util.demo_e2v import make_e2v_dataset
from seed_configs import fixture_text

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4   # 6 clips in batches of 2: step 4 is in the second epoch; backups at steps 2 and 4


def run_train(tiny_model, dataset_config: Path, run: Path, hash_seed: str, *extra: str,
              kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WAN_TRAINER_KILL_AT", None)
    if kill_at:
        env["WAN_TRAINER_KILL_AT"] = kill_at
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--model_name", str(tiny_model("wan2.1-t2v")),
               "--training_type", "e2v-lora", "--output_dir", str(run / "output"), "--dataset_configs",
               str(dataset_config), "--e2v_type", "dual", "--frame_conditioning_type", "random",
               "--mixed_precision", "no", "--rank", "4", "--lora_alpha", "4"]
    for value in [f"model.image_encoder.path={tiny_model('wan2.1-i2v')}", "device=cpu", f"max_steps={STEPS}",
                  "batch_size=2", f"cache_dir={run / 'cache'}", f"workspace_dir={run / 'workspace'}",
                  "backup.every_n_steps=2", "data.dataloader_threads=0", "tensorboard=true", *extra]:
        command += ["--config-value", value]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def step_losses(run: Path) -> list[float]:
    logs = list((run / "workspace" / "tensorboard").iterdir())
    assert len(logs) == 1, logs
    events = EventAccumulator(str(logs[0]))
    events.Reload()
    return [event.value for event in events.Scalars("loss/step")]


def assert_bit_equal(path_a: Path, path_b: Path) -> None:
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, different


@pytest.fixture(scope="module")
def e2v_runs(tiny_model, tmp_path_factory):
    """Seed 001's dataset config at 32x32 on the demo's E2V clips, trained uninterrupted by two processes that differ
    only in PYTHONHASHSEED."""
    root = tmp_path_factory.mktemp("e2v_determinism")
    data = make_e2v_dataset(root / "data", clips_per_class=1, frames=17)
    config = json.loads(fixture_text("001"))
    dataset = config["datasets"][0]
    dataset["data_root"] = str(data)
    dataset["target_resolution"] = [32, 32]
    dataset["processors"]["vae"]["resolution"] = [32, 32]
    dataset["processors"]["clip"]["resolution"] = [32, 32]
    dataset_config = root / "e2v.json"
    dataset_config.write_text(json.dumps(config))
    for hash_seed in ("1", "2"):
        result = run_train(tiny_model, dataset_config, root / f"hash{hash_seed}", hash_seed)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, dataset_config


def test_e2v_training_does_not_depend_on_the_python_hash_seed(e2v_runs):
    root, _ = e2v_runs
    losses = step_losses(root / "hash1")
    assert len(losses) == STEPS
    assert step_losses(root / "hash2") == losses          # bit-equal, not approximately
    assert_bit_equal(root / "hash1" / "output" / "e2v_lora.safetensors",
                     root / "hash2" / "output" / "e2v_lora.safetensors")


def test_killed_e2v_run_resumes_bit_identical(tiny_model, e2v_runs):
    root, dataset_config = e2v_runs
    run = root / "killed"
    # SIGKILL between step 3's backward and its optimizer step; the backup of step 2 is the newest
    killed = run_train(tiny_model, dataset_config, run, "1", kill_at="step:3")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert not (run / "output" / "e2v_lora.safetensors").exists()
    # resumed in a new process with another hash seed
    resumed = run_train(tiny_model, dataset_config, run, "3", "backup.continue_last_backup=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step-00000002" in resumed.stdout + resumed.stderr, "the resume did not start from the step-2 backup"
    assert_bit_equal(run / "output" / "e2v_lora.safetensors", root / "hash1" / "output" / "e2v_lora.safetensors")
