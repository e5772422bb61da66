"""It resumes, for E2V: an E2V run killed mid-step resumes in a new process to the bit-identical LoRA of the run that
never stopped, whatever each process's PYTHONHASHSEED (str hashes, and so the iteration order of sets of strings,
change with it). The T2V base is expanded (image branch: its add_v_proj starts at 0, so add_k_proj's initialisation
shows only from step 2 on) and frame_conditioning is random (a slot subset drawn per item and epoch)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from modules.util.demo_e2v import make_e2v_dataset
from seed_configs import fixture_text

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4   # 6 clips in batches of 2: step 4 is in the second epoch; backups at steps 2 and 4


def train_command(tiny_model, dataset_config: Path, run: Path, *extra: str) -> list[str]:
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--model_name", str(tiny_model("wan2.1-t2v")),
               "--training_type", "e2v-lora", "--output_dir", str(run / "output"), "--dataset_configs",
               str(dataset_config), "--e2v_type", "dual", "--frame_conditioning_type", "random",
               "--mixed_precision", "no", "--rank", "4", "--lora_alpha", "4"]
    for value in [f"model.image_encoder.path={tiny_model('wan2.1-i2v')}", "device=cpu", f"max_steps={STEPS}",
                  "batch_size=2", f"cache_dir={run / 'cache'}", f"workspace_dir={run / 'workspace'}",
                  "backup.every_n_steps=2", "data.dataloader_threads=0", "tensorboard=false", *extra]:
        command += ["--config-value", value]
    return command


def environment(hash_seed: str, kill_at: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WAN_TRAINER_KILL_AT", None)
    return env | ({"WAN_TRAINER_KILL_AT": kill_at} if kill_at else {})


def assert_bit_equal(path_a: Path, path_b: Path) -> None:
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, different


def step_2_backup(run: Path) -> Path:
    """The step-2 backup's trainable weights (found by name: where backups lie is the workspace's business)."""
    return next((run / "workspace").rglob("step-00000002")) / "trainable.safetensors"


def test_killed_e2v_run_resumes_bit_identical_whatever_the_hash_seed(tiny_model, tmp_path):
    data = make_e2v_dataset(tmp_path / "data", clips_per_class=1, frames=17)
    config = json.loads(fixture_text("001"))    # seed 001's dataset config at the tiny model's 32x32
    dataset = config["datasets"][0]
    dataset["data_root"] = str(data)
    dataset["target_resolution"] = [32, 32]
    dataset["processors"]["vae"]["resolution"] = [32, 32]
    dataset["processors"]["clip"]["resolution"] = [32, 32]
    dataset_config = tmp_path / "e2v.json"
    dataset_config.write_text(json.dumps(config))
    reference, run = tmp_path / "uninterrupted", tmp_path / "killed"
    # side by side: the run that never stops (PYTHONHASHSEED=1), and one killed with SIGKILL between step 3's
    # backward and its optimizer step (PYTHONHASHSEED=2); each caches, expands and initialises on its own
    processes = [subprocess.Popen(train_command(tiny_model, dataset_config, folder), env=environment(*env),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for folder, env in ((reference, ("1",)), (run, ("2", "step:3")))]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert processes[0].returncode == 0, outputs[0][-3000:]
    assert processes[1].returncode == -signal.SIGKILL, outputs[1][-3000:]
    assert not (run / "output" / "e2v_lora.safetensors").exists()
    # the first two steps did not depend on the hash seed
    assert_bit_equal(step_2_backup(run), step_2_backup(reference))

    # resumed in a third process, with a third hash seed, from the step-2 backup
    resumed = subprocess.run(train_command(tiny_model, dataset_config, run, "backup.continue_last_backup=true"),
                             capture_output=True, text=True, timeout=300, env=environment("3"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step-00000002" in resumed.stdout + resumed.stderr, "the resume did not start from the step-2 backup"
    assert_bit_equal(run / "output" / "e2v_lora.safetensors", reference / "output" / "e2v_lora.safetensors")
