"""A run never takes another run's work: a resume continues only the run whose settings are this run's, two runs
started in the same second get their own folders, a run whose every backup is damaged stops at every retry, and an
output another run wrote is kept beside the new one. Each test failed before the change (see its comments)."""
import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from learning import train
from modules.trainer.backup_io import list_backups, write_manifest
from modules.trainer.GenericTrainer import TrainingError
from modules.trainer.run_matching import run_to_continue
from modules.util.config.config_io import ConfigError, load_config
from modules.util.demo_assets import make_t2v_dataset


@pytest.fixture(scope="module")
def six_clips(tmp_path_factory):
    return make_t2v_dataset(tmp_path_factory.mktemp("six") / "squares", clips_per_class=1)


@pytest.fixture(scope="module")
def finished_run(tiny_model, six_clips, tmp_path_factory):
    """A 2-step run with a backup after each step and its output, in a folder the tests copy."""
    folder = tmp_path_factory.mktemp("finished")
    trainer = train(folder, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=["backup.every_n_steps=1"])
    return folder, trainer


def copy_run(finished_run, tmp_path: Path, output: bool = False) -> str:
    folder, trainer = finished_run
    shutil.copytree(folder / "run", tmp_path / "run")
    if output:
        shutil.copy2(folder / "out.safetensors", tmp_path / "out.safetensors")
    # the copy's outputs are this folder's: the run wrote tmp_path/out.safetensors here
    for path in [*(tmp_path / "run" / "backup").rglob("config.json"), *(tmp_path / "run" / "run-configs").iterdir()]:
        recorded = json.loads(path.read_text())
        recorded["output"]["destination"] = str(tmp_path / "out.safetensors")
        path.write_text(json.dumps(recorded))
        if path.name == "config.json":
            write_manifest(path.parent)
    return trainer.run_name


@pytest.mark.parametrize("overrides, reason", [
    (["output.destination={tmp}/second.safetensors"], "it writes '{tmp}/out.safetensors', this run "
                                                      "'{tmp}/second.safetensors'"),
    (["max_steps=1"], "its newest backup is at step 2, past this run's max_steps 1"),
])
def test_a_resume_without_a_run_of_its_settings_is_refused_naming_run_name(overrides, reason, finished_run,
                                                                           tiny_model, six_clips, tmp_path):
    # a run killed before its first backup, resumed: before, it continued the other run (exit 0), saved that run's
    # weights as its own output and rewrote that run's recorded config with its own settings
    name = copy_run(finished_run, tmp_path)
    recorded = tmp_path / "run" / "run-configs" / f"{name}.json"
    before = recorded.read_bytes()
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    steps = 1 if "max_steps=1" in overrides else 3
    with pytest.raises(ConfigError) as error:
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=steps,
              overrides=overrides + ["backup.continue_last_backup=true"])
    message = str(error.value)
    assert f"run {name}: {reason.replace('{tmp}', str(tmp_path))}" in message, message
    assert f"set run_name={name}" in message and "backup.continue_last_backup=false" in message
    assert recorded.read_bytes() == before
    assert not (tmp_path / "second.safetensors").exists() and not (tmp_path / "out.safetensors").exists()


def test_a_resume_continues_the_newest_run_of_its_settings_past_a_newer_other_run(finished_run, tmp_path):
    name = copy_run(finished_run, tmp_path)
    base = tmp_path / "run" / "backup"
    # a newer run of another output
    newer = base / "newer"
    shutil.copytree(list_backups(base / name)[-1], newer / "step-00000002")
    recorded = json.loads((newer / "step-00000002" / "config.json").read_text())
    recorded["output"]["destination"] = str(tmp_path / "other.safetensors")
    (newer / "step-00000002" / "config.json").write_text(json.dumps(recorded))
    write_manifest(newer / "step-00000002")
    config = load_config(overrides=[f"output.destination={tmp_path / 'out.safetensors'}", "max_steps=3"])
    assert run_to_continue(base, config) == name
    config.output.destination = str(tmp_path / "other.safetensors")
    assert run_to_continue(base, config) == "newer"


def test_a_retry_after_every_backup_was_damaged_stops_again_until_told(finished_run, tiny_model, six_clips, tmp_path,
                                                                        capsys):
    name = copy_run(finished_run, tmp_path, output=True)
    first_output = (tmp_path / "out.safetensors").read_bytes()
    for backup in (tmp_path / "run" / "backup" / name).glob("step-*"):
        (backup / "manifest.json").unlink()
    resume = ["backup.continue_last_backup=true"]
    with pytest.raises(TrainingError, match=f"every backup of run {name} is damaged"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=resume)
    # before: the same command again found no backup, started fresh and replaced the output
    with pytest.raises(TrainingError, match=f"every backup of run {name} is damaged .set aside earlier as "
                                            f"step-00000001.damaged, step-00000002.damaged"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=resume)
    assert (tmp_path / "out.safetensors").read_bytes() == first_output
    capsys.readouterr()
    # the user says so: a new run, and the first run's output is kept beside the new one (before: replaced)
    again = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=1,
                  overrides=["backup.continue_last_backup=false"])
    out = capsys.readouterr().out
    kept = tmp_path / f"out.previous-{name}.safetensors"
    assert f"{tmp_path / 'out.safetensors'} exists, written by run {name}: it is kept as {kept.name}" in out, out
    assert f"note: {tmp_path / 'out.safetensors'} was written by run {name}: kept as {kept}" in out
    assert kept.read_bytes() == first_output
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as file:
        assert json.loads(file.metadata()["training_config"])["run_name"] == again.run_name != name


def test_two_runs_started_in_the_same_second_get_their_own_names(tmp_path, monkeypatch):
    from modules.trainer.run_report import resolve_run_name
    monkeypatch.setattr(time, "strftime", lambda *_: "2026-01-01_00-00-00")
    config = load_config()
    names = [resolve_run_name(config, tmp_path) for _ in range(3)]
    # before: the name was picked before any folder existed, so runs starting together all got the first one
    assert names == ["2026-01-01_00-00-00", "2026-01-01_00-00-00-2", "2026-01-01_00-00-00-3"]
    assert all((tmp_path / "backup" / name).is_dir() for name in names)


def test_a_finished_run_resumed_to_train_on_keeps_its_finished_output(tiny_model, six_clips, tmp_path, capsys):
    # run 1 trains 6 steps and saves; the same command with max_steps=10 is killed before its first backup and
    # resumed: the resume continues run 1 (the newest run of these settings), and before it replaced run 1's
    # finished output with no copy kept
    import os
    import subprocess
    import sys

    from multi_gpu_runs import cli_arguments
    base = tiny_model("wan2.1-t2v")
    first = train(tmp_path, base, six_clips, steps=6)
    finished = (tmp_path / "out.safetensors").read_bytes()
    root = Path(__file__).resolve().parent.parent
    killed = subprocess.run([sys.executable, str(root / "scripts" / "train.py"), *cli_arguments(
        base, six_clips, tmp_path, tmp_path / "cache", ["max_steps=10", "batch_size=4", "output.format=COMFY_LORA"])],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, WAN_TRAINER_KILL_AT="step:1", OMP_NUM_THREADS="1"))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (tmp_path / "out.safetensors").read_bytes() == finished
    capsys.readouterr()
    resumed = train(tmp_path, base, six_clips, steps=10, overrides=["backup.continue_last_backup=true"])
    out = capsys.readouterr().out
    assert resumed.run_name == first.run_name and resumed.resumed_step == 6 and len(resumed.step_losses) == 4
    kept = list(tmp_path.glob(f"out.previous-{first.run_name}-*.safetensors"))
    assert len(kept) == 1 and kept[0].read_bytes() == finished, kept
    assert f"note: {tmp_path / 'out.safetensors'} was written by run {first.run_name} itself before this start" in out
    assert f"kept as {kept[0]}" in out
    assert (tmp_path / "out.safetensors").read_bytes() != finished
