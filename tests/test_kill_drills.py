"""The reliability drills of docs/reliability.md: the demo run (training_presets/#demo tiny CPU.json, shortened) is
killed with SIGKILL at five points (caching, mid-step, mid-backup, mid-sample, mid-save) through the
WAN_TRAINER_KILL_AT test hook (modules/util/kill_points.py); each resume must end with exactly the weights of the
uninterrupted run and leave no temporary or unloadable file behind."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from modules.trainer.backup_io import all_backups
from modules.trainer.GenericTrainer import GenericTrainer
from modules.trainer.prepare import prepare_config
from modules.util.config.config_io import load_config
from modules.util.demo_assets import make_t2v_dataset

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "training_presets" / "#demo tiny CPU.json"

# (kill point, what the resume starts from). Backups at steps 2 and 4 and one before the final save; previews at
# steps 2 and 4, each writing an .mp4 and then a .png (two kill points per preview).
# (kill point, where the resume starts, how many of the 4 steps it trains again)
DRILLS = [
    ("caching:5", "a fresh start on a cache that kept the 4 complete entries", 4),
    ("step:3", "the backup of step 2", 2),
    ("backup:2", "the backup of step 2 (step 4's was being written)", 2),
    ("sample:3", "a fresh start: the demo's two prompts preview before training, so the third video is step 2's, "
                 "which is made before step 2's backup", 4),
    ("save:1", "the backup written before the final save: it only saves", 0),
]


@pytest.fixture(scope="module")
def demo(tiny_model, tmp_path_factory):
    """The demo preset, shortened: 6 clips, 4 steps, backups and previews every 2 steps. Only what the drills need
    differs from the preset (paths to the tiny model and this test's folders, and the short schedule)."""
    root = tmp_path_factory.mktemp("drills")
    dataset = make_t2v_dataset(root / "squares", clips_per_class=1)
    samples = root / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9,
                                    "steps": 2, "seed": 1}]))

    def values(run: Path) -> list[str]:
        return ["demo_assets=false", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
                f'data.concepts=[{{"path": "{dataset}"}}]', f"workspace_dir={run / 'workspace'}",
                f"cache_dir={run / 'cache'}", f"output.destination={run / 'output' / 'demo_lora.safetensors'}",
                "max_steps=4", "backup.every_n_steps=2", f"sampling.samples_file={samples}",
                "sampling.every_n_steps=2", "tensorboard=false"]

    def train_in_process(run: Path, *extra: str) -> GenericTrainer:
        config = load_config(preset_path=str(PRESET), overrides=values(run) + list(extra))
        trainer = GenericTrainer(config, e2v_datasets=prepare_config(config))
        trainer.train()
        return trainer

    reference = train_in_process(root / "uninterrupted")
    return values, train_in_process, load_file(str(root / "uninterrupted" / "output" / "demo_lora.safetensors")), \
        reference


def assert_every_file_loads(run: Path) -> None:
    from modules.trainer.backup_io import verify_backup
    leftovers = [p for p in run.rglob(".*") if p.name.endswith(".tmp") or p.name.endswith(".old")]
    assert not leftovers, leftovers
    for path in run.rglob("*.safetensors"):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                file.get_tensor(key)
    for backup in all_backups(run / "workspace" / "backup"):
        assert verify_backup(backup) == [], backup


@pytest.mark.parametrize("kill_at,resumes_from,steps_again", DRILLS, ids=[d[0] for d in DRILLS])
def test_killed_demo_run_resumes_to_the_same_weights(kill_at, resumes_from, steps_again, demo, tmp_path):
    values, train_in_process, expected, reference = demo
    run = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--preset-path", str(PRESET)]
    for value in values(run):
        command += ["--config-value", value]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "WAN_TRAINER_KILL_AT": kill_at, "PYTHONUNBUFFERED": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    if kill_at.split(":")[0] in ("backup", "sample", "save"):
        # the kill left the temporary file or folder of the write it interrupted (for the next start to remove)
        assert [p for p in run.rglob(".*") if p.name.endswith(".tmp")], kill_at

    resumed = train_in_process(run, "backup.continue_last_backup=true")
    assert_every_file_loads(run)
    final = load_file(str(run / "output" / "demo_lora.safetensors"))
    assert final.keys() == expected.keys()
    difference = max(float((final[key] - expected[key]).abs().max()) for key in expected)
    print(f"drill {kill_at}: {len(resumed.step_losses)} step(s) trained after the resume, largest weight "
          f"difference from the uninterrupted run {difference:g}")
    assert difference <= 1e-6, kill_at
    # the resume started where it should (a resume that ignored the backup would train all 4 steps again to the
    # same weights) and trained exactly the steps the killed run had not finished
    assert len(resumed.step_losses) == steps_again, resumes_from
    assert resumed.step_losses == pytest.approx(reference.step_losses[len(reference.step_losses) - steps_again:],
                                                abs=1e-6)
