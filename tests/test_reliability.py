"""Issue 15 section 1: nothing a run has learned is ever lost. Previews checked before step 0 and skipped when they
fail later; a backup before the final save and a failed save that says where the weights are; Ctrl-C prints the
resume command; intermediate saves kept to the newest N; damaged backups skipped for the newest complete one; only
finite weights are backed up; leftovers of killed writes removed; caching stops cleanly on Ctrl-C; an output folder
is refused before training; writes are fsynced before their rename. (The kill drills are in test_kill_drills.py.)"""
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from learning import train
from modules.modelSetup.BaseWanSetup import BaseWanSetup
from modules.trainer.backup_io import all_backups, list_backups, read_backup
from modules.trainer.GenericTrainer import TrainingError
from modules.util import atomic
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.validation import check_paths
from modules.util.demo_assets import make_t2v_dataset

ROOT = Path(__file__).resolve().parent.parent
KILL_AT = "WAN_TRAINER_KILL_AT"  # the test hook of modules/util/kill_points.py
SAMPLE = {"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9, "steps": 2, "seed": 1}


def load_train_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def six_clips(tmp_path_factory):
    """One clip per caption (6 clips): a run caches in a fraction of the squares fixture's time."""
    return make_t2v_dataset(tmp_path_factory.mktemp("six") / "squares", clips_per_class=1)


def cli_values(tmp_path: Path, base: Path, dataset: Path, steps: int) -> list[str]:
    values = [f"model.base_model_name={base}", f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}",
              f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu", "train_dtype=FLOAT_32",
              "gradient_checkpointing=false", f"max_steps={steps}", "batch_size=4",
              f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]", "data.resolution=32",
              "data.aspect_ratios=[1.0]", "data.dataloader_threads=0", "tensorboard=false"]
    return [item for value in values for item in ("--config-value", value)]


# ---- previews ------------------------------------------------------------------------------------------------

def test_a_preview_the_model_cannot_sample_is_a_config_error_before_training(tiny_model, six_clips, tmp_path,
                                                                             capsys):
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([SAMPLE]))  # no first frame: an I2V model cannot sample it
    args = cli_values(tmp_path, tiny_model("wan2.1-i2v"), six_clips, steps=2) + [
        "--config-value", f"sampling.samples_file={samples}", "--config-value", "sampling.every_n_steps=1"]
    assert load_train_script().main(args) == 2
    error = capsys.readouterr().err
    assert "sampling.samples_file" in error and "needs a first frame" in error, error
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # stopped before caching, let alone training
    assert not (tmp_path / "out.safetensors").exists()


def test_a_failing_preview_is_logged_and_skipped_while_training_goes_on(tiny_model, six_clips, tmp_path, caplog,
                                                                      monkeypatch):
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([SAMPLE]))
    image = tmp_path / "frame.png"
    Image.new("RGB", (32, 32)).save(image)
    original_save = Image.Image.save

    def disk_full_while_writing_png(self, fp, format=None, **params):
        if str(format).upper() == "PNG" or str(fp).endswith(".png"):
            Path(fp).write_bytes(b"\x89PNG partial")
            raise OSError(28, "No space left on device")
        return original_save(self, fp, format, **params)

    def edit_samples(info):
        # the samples file is read at every preview (after this callback) and edited while the run goes on
        if info["step"] == 2:  # an image a T2V model cannot take
            samples.write_text(json.dumps([{**SAMPLE, "image": str(image)}]))
        if info["step"] == 3:  # valid again, but the strip PNG hits a full disk
            samples.write_text(json.dumps([SAMPLE]))
            monkeypatch.setattr(Image.Image, "save", disk_full_while_writing_png)

    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=3, on_update=edit_samples,
                    overrides=[f"sampling.samples_file={samples}", "sampling.every_n_steps=1"])
    assert trainer.progress.global_step == 3 and (tmp_path / "out.safetensors").is_file()
    assert trainer.hooks.sampler.failures == 2
    failures = [r.getMessage() for r in caplog.records if "failed and is skipped" in r.getMessage()]
    assert len(failures) == 2 and "text-to-video" in failures[0] and "No space left" in failures[1], failures
    folder = next(trainer.samples_dir.iterdir())  # <workspace>/samples/<run>/<prompt>/
    # <step>-<epoch>.<suffix>; each preview's settings file (.json) is written with its video
    written = sorted(p.name.split("-")[0] + p.suffix for p in folder.iterdir() if p.suffix != ".json")
    assert written == ["1.mp4", "1.png", "3.mp4"]  # step 2 made nothing, step 3 no partial PNG


# ---- saves ---------------------------------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A real, full file system: a 256 KiB tmpfs filled to the last byte (mounting needs root: skipped without)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; test_a_save_that_cannot_write covers the rest")
    try:
        earlier = disk / "out.safetensors"
        earlier.write_bytes(b"an earlier run's file")
        with open(disk / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def check_failed_save(error: str, destination: Path, tmp_path: Path) -> None:
    from modules.trainer.backup_io import verify_backup
    assert f"saving {destination} failed" in error, error
    backup = next((tmp_path / "run" / "backup").glob("*/step-00000002"))  # the run's own folder
    assert f"kept in the backup {backup}" in error and "backup.continue_last_backup=true" in error, error
    assert not verify_backup(backup)


def test_a_final_save_on_a_full_disk_keeps_the_weights_in_a_backup(tiny_model, six_clips, tmp_path, full_disk):
    destination = full_disk / "out.safetensors"
    with pytest.raises(TrainingError) as failure:
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
              overrides=[f"output.destination={destination}"])
    check_failed_save(str(failure.value), destination, tmp_path)
    assert "No space left on device" in str(failure.value)
    assert destination.read_bytes() == b"an earlier run's file"  # the earlier file is intact
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "out.safetensors"]  # no temporary left

    # as the message says: the same run, resumed with room to save, saves without training a step
    run = next((tmp_path / "run" / "backup").glob("*/step-00000002")).parent.name
    assert f"--config-value run_name={run}" in str(failure.value)  # another output is another run's, unless named
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
                    overrides=["backup.continue_last_backup=true", f"run_name={run}",
                               f"output.destination={tmp_path / 'roomy.safetensors'}"])
    assert resumed.step_losses == [] and resumed.progress.global_step == 2
    saved = load_file(str(tmp_path / "roomy.safetensors"))
    assert saved and all(torch.isfinite(v).all() for v in saved.values())


def test_a_save_that_cannot_write_names_the_path_and_the_backup(tiny_model, six_clips, tmp_path):
    """Without root (no tmpfs): the output's folder turns into a file while the run trains (a folder that passed the
    checks at start but cannot be written at the end), an OSError from the same place a full disk raises."""
    (tmp_path / "outputs").mkdir()
    destination = tmp_path / "outputs" / "out.safetensors"

    def folder_replaced_by_a_file(info):
        if info["step"] == 2:
            (tmp_path / "outputs").rmdir()
            (tmp_path / "outputs").write_text("a file")

    with pytest.raises(TrainingError) as failure:
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, on_update=folder_replaced_by_a_file,
              overrides=[f"output.destination={destination}"])
    check_failed_save(str(failure.value), destination, tmp_path)


def test_a_backup_before_the_save_that_cannot_be_written_still_saves_the_output(tiny_model, six_clips, tmp_path,
                                                                                 caplog):
    """The workspace's disk fails (its backup folder turns into a file) while the output's has room: before, the run
    stopped with neither a backup nor an output, and everything it had trained was lost."""
    def backup_folder_replaced_by_a_file(info):
        if info.get("step") == 2:
            shutil.rmtree(tmp_path / "run" / "backup", ignore_errors=True)
            (tmp_path / "run" / "backup").write_text("a file")

    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, on_update=backup_folder_replaced_by_a_file)
    assert trainer.completed and trainer.progress.global_step == 2
    assert any(r.getMessage().startswith("writing the backup ") and "saving the output anyway" in r.getMessage()
               for r in caplog.records)
    saved = load_file(str(tmp_path / "out.safetensors"))
    assert saved and all(torch.isfinite(v).all() for v in saved.values())


def test_a_resume_at_max_steps_saves_and_stops(tiny_model, six_clips, tmp_path):
    first = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=["backup.every_n_steps=2"])
    (tmp_path / "out.safetensors").unlink()  # as if killed while writing it
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
                    overrides=["backup.every_n_steps=2", "backup.continue_last_backup=true"])
    assert resumed.step_losses == [] and resumed.progress.global_step == 2  # no step 3
    saved, expected = load_file(str(tmp_path / "out.safetensors")), first.setup.trainable_state_dict()
    assert len(saved) >= len(expected)
    for name, value in resumed.setup.trainable_state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0)


def test_intermediate_saves_keep_the_newest_n(tiny_model, six_clips, tmp_path):
    train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=4,
          overrides=["backup.save_every_n_steps=1", "backup.save_rolling_count=2"])
    assert sorted(p.name for p in (tmp_path / "run" / "save").iterdir()) == \
        ["step-00000003.safetensors", "step-00000004.safetensors"]


def test_an_existing_folder_as_output_destination_is_a_config_error(tiny_model, six_clips, tmp_path):
    (tmp_path / "loras").mkdir()
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}",
                                    f'data.concepts=[{{"path": "{six_clips}"}}]',
                                    f"output.destination={tmp_path / 'loras'}"])
    with pytest.raises(ConfigError, match="output.destination: .* is an existing folder"):
        check_paths(config)


# ---- Ctrl-C --------------------------------------------------------------------------------------------------

def test_ctrl_c_prints_the_exact_command_that_resumes(tiny_model, six_clips, tmp_path, monkeypatch):
    command = [sys.executable, str(ROOT / "scripts" / "train.py")] + cli_values(tmp_path, tiny_model("wan2.1-t2v"),
                                                                                six_clips, steps=3)
    # Ctrl-C in step 2, sent by the test hook so that it lands at the same point every time
    stopped = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, KILL_AT: "step:2:INT"})
    assert stopped.returncode == 130, stopped.stderr[-2000:]  # interrupted: `train && convert` must not go on
    assert "Traceback" not in stopped.stderr
    lines = stopped.stdout.splitlines()
    resume_line = lines[lines.index("stopped; to resume, run:") + 1].strip()
    (stopped_backup,) = all_backups(tmp_path / "run" / "backup")
    assert stopped_backup.name == "step-00000002"
    # another run writes to the workspace before the user resumes: the printed line still continues the stopped run
    # (before, it named no run and took the backup written last, the other run's)
    train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=1)
    # run the printed line as printed, in-process to save an interpreter start: `cd DIR && PYTHON SCRIPT ARGS...`
    cd, folder, conjunction, python, script, *args = shlex.split(resume_line)
    assert (cd, conjunction, python, Path(script)) == ("cd", "&&", sys.executable, ROOT / "scripts" / "train.py")
    monkeypatch.chdir(folder)
    assert load_train_script().main(args) == 0
    assert (tmp_path / "out.safetensors").is_file()
    assert read_backup(list_backups(stopped_backup.parent)[-1])["progress"].global_step == 3


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_while_caching_stops_cleanly_and_keeps_the_cache(inherited, tiny_model, six_clips, tmp_path,
                                                                 monkeypatch, capsys):
    """`ignored`: the trainer started as a non-interactive shell's background job (`train ... &`) starts, with
    SIGINT ignored, where Python installs no KeyboardInterrupt handler (this drill once failed only in full test runs
    started that way: the caching went on, trained and saved)."""
    import signal

    from modules.util import kill_points
    monkeypatch.setenv(KILL_AT, "caching:3:INT")
    monkeypatch.setattr(kill_points, "_counts", {})
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if inherited == "ignored" else signal.default_int_handler)
    try:
        trainer = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2)
        assert signal.getsignal(signal.SIGINT) is (signal.SIG_IGN if inherited == "ignored" else
                                                   signal.default_int_handler)   # put back after the run
    finally:
        signal.signal(signal.SIGINT, before)
    assert trainer.stop_requested.is_set() and trainer.progress.global_step == 0
    assert "caching stopped by Ctrl-C" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 2  # the third was being written
    assert not [p for p in (tmp_path / "cache").rglob(".*") if p.is_file()]
    assert not (tmp_path / "out.safetensors").exists()
    # no backup of this run exists: the advice is the same command again, not a resume (which would continue
    # whichever other run of the workspace was written last)
    advice = load_train_script().stop_advice(trainer, ["--config-path", "my.json"], "stopped; to resume")
    assert "stopped before this run wrote a backup" in advice and "continue_last_backup" not in advice, advice


# ---- backups -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_backups(tiny_model, six_clips, tmp_path_factory):
    """A 2-step run with a backup after each step: (its folder, the trainer)."""
    folder = tmp_path_factory.mktemp("two-backups")
    trainer = train(folder, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=["backup.every_n_steps=1"])
    return folder, trainer


DAMAGES = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:-7]),
    "emptied": lambda path: path.write_bytes(b""),
    "garbled": lambda path: path.write_bytes(b"\xff" * 16 + path.read_bytes()[16:]),
}


@pytest.mark.parametrize("name", ["trainable.safetensors", "optimizer.json", "progress.json", "rng.safetensors"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_backup_is_found_and_the_newest_complete_one_chosen(name, damage, two_backups, tmp_path):
    from modules.trainer.backup_io import newest_usable_backup
    root = tmp_path / "backup"
    shutil.copytree(two_backups[1].backup_root, root)  # the run's own backup folder
    DAMAGES[damage](root / "step-00000002" / name)
    folder, damaged = newest_usable_backup(root)
    assert folder == root / "step-00000001"
    assert [bad for bad, _ in damaged] == [root / "step-00000002"]
    assert any(problem.startswith(name) for problem in damaged[0][1]), damaged


def test_resume_skips_a_damaged_newest_backup_with_a_warning(two_backups, tiny_model, six_clips, tmp_path, capsys):
    folder, full = two_backups
    shutil.copytree(folder / "run" / "backup", tmp_path / "run" / "backup")
    DAMAGES["truncated"](next((tmp_path / "run" / "backup").glob("*/step-00000002")) / "trainable.safetensors")
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,  # the copied run, by its name
                    overrides=["backup.every_n_steps=1", "backup.continue_last_backup=true",
                               f"run_name={full.run_name}"])
    out = capsys.readouterr().out
    assert "backup" in out and "step-00000002 is damaged and is skipped (trainable.safetensors" in out, out
    assert "resuming from" in out and "step-00000001" in out
    assert resumed.step_losses == pytest.approx(full.step_losses[1:], abs=1e-6)  # step 2 trained again, the same


def test_non_finite_weights_are_never_backed_up(tiny_model, six_clips, tmp_path, monkeypatch):
    original = BaseWanSetup.calculate_loss
    calls = []

    def overflowing_backward(self, batch, prediction):
        # from the third batch on, the loss stays finite but its gradient is NaN (as an fp16 overflow in backward
        # makes it): 0 * sqrt(|x - x|) is 0 forward, 0 * inf backward
        calls.append(1)
        loss = original(self, batch, prediction)
        if len(calls) >= 3:
            delta = prediction.predicted - prediction.predicted.detach()
            loss = loss + 0 * torch.sqrt(delta.abs()).sum()
        return loss

    monkeypatch.setattr(BaseWanSetup, "calculate_loss", overflowing_backward)
    with pytest.raises(TrainingError, match=r"non-finite by step 3.*no backup was written.*step-00000002"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=5, overrides=["backup.every_n_steps=1"])
    backups = all_backups(tmp_path / "run" / "backup")
    assert [b.name for b in backups] == ["step-00000001", "step-00000002"]
    for backup in backups:
        assert all(torch.isfinite(v).all() for v in read_backup(backup)["trainable"].values())


# ---- files left by killed writes, fsync ----------------------------------------------------------------------

def test_leftovers_of_killed_writes_are_removed_at_the_next_start(tiny_model, six_clips, tmp_path):
    leftovers = [tmp_path / "run" / "backup" / ".step-00000004.k9xjgzvh.tmp" / "trainable.safetensors",
                 tmp_path / "run" / "save" / ".step-00000004.safetensors.a1b2c3d4.tmp",
                 tmp_path / "run" / "samples" / "0-a-red-square" / ".4-0.mp4.x_y1z2w3.tmp",
                 tmp_path / "cache" / "latents" / "ab" / ".abcdef.safetensors.qwertyui.tmp",
                 tmp_path / ".out.safetensors.zxcvbnm1.tmp"]
    kept = [tmp_path / ".notes.txt.abcdefgh.tmp",  # the output folder is the user's: only the output's own go
            tmp_path / "run" / "notes.txt"]
    for path in leftovers + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=1)
    assert [p for p in leftovers if p.exists()] == []
    assert not (tmp_path / "run" / "backup" / ".step-00000004.k9xjgzvh.tmp").exists()
    assert all(p.exists() for p in kept)


def test_atomic_writes_fsync_file_and_folder_before_and_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b)))

    target = tmp_path / "out.safetensors"
    atomic.save_safetensors_atomic({"x": torch.ones(2)}, target)
    (_, synced), (_, source, renamed), (_, folder) = events
    assert synced == source and renamed == str(target) and folder == str(tmp_path)

    events.clear()
    with atomic.atomic_dir(tmp_path / "backup") as tmp:
        (tmp / "a.json").write_text("{}")
    names = [Path(e[1]).name for e in events]
    assert events[0][0] == "fsync" and names[0] == "a.json"  # the file, then its folder, then the rename
    assert events[1][0] == "fsync" and events[2][0] == "rename" and events[3] == ("fsync", str(tmp_path))
