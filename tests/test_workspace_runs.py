"""Issue 23: runs that share a workspace never destroy or borrow each other's work, and every fault ends cleanly.
Each test here failed on the main of before the change (backups in one shared folder pruned by step number, resume
of the newest backup of any run, demo squares generated into a mistyped folder, Ctrl-C tracebacks during the final
backup, bit flips resumed from silently, a raw traceback for a full cache folder)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from learning import train
from modules.trainer.backup_io import (all_backups, choose_backup, list_backups, verify_backup, workspace_backups,
                                       write_backup, TrainProgress)
from modules.trainer.GenericTrainer import TrainingError
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.dataset_toml import merge_dataset_settings
from modules.util.demo_assets import make_t2v_dataset

ROOT = Path(__file__).resolve().parent.parent
KILL_AT = "WAN_TRAINER_KILL_AT"  # the test hook of modules/util/kill_points.py
DEMO = str(ROOT / "training_presets" / "#demo tiny CPU.json")


@pytest.fixture(scope="module")
def six_clips(tmp_path_factory):
    return make_t2v_dataset(tmp_path_factory.mktemp("six") / "squares", clips_per_class=1)


def steps_of(folders) -> list[int]:
    return [json.loads((f / "progress.json").read_text())["global_step"] for f in folders]


# ---- 1. a workspace holds many runs ------------------------------------------------------------------------------

def test_a_second_run_keeps_its_own_backups_and_never_touches_the_firsts(tiny_model, six_clips, tmp_path):
    every_step = ["backup.every_n_steps=1", "backup.rolling_count=2"]
    first = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=3, overrides=every_step)
    first_backups = {p: (p / "trainable.safetensors").read_bytes() for p in list_backups(first.backup_root)}
    assert steps_of(first_backups) == [2, 3]
    second = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=every_step)
    assert second.backup_root != first.backup_root
    # the second run's backups survive its own pruning (before: pruned against the first run's higher steps)
    assert steps_of(list_backups(second.backup_root)) == [1, 2]
    # and the first run's are exactly as written (before: its step folders were overwritten or deleted)
    assert {p: (p / "trainable.safetensors").read_bytes() for p in list_backups(first.backup_root)} == first_backups
    assert set(workspace_backups(tmp_path / "run" / "backup")) == {first.run_name, second.run_name}


def test_a_resume_continues_the_run_written_last_and_prunes_after_a_kill(tiny_model, six_clips, tmp_path, capsys):
    every_step = ["backup.every_n_steps=1", "backup.rolling_count=2"]
    first = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=4, overrides=every_step)
    second = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=every_step)
    # a kill between writing a backup and pruning the older ones leaves one too many: the resume prunes it
    extra = second.backup_root / "step-00000000"
    shutil.copytree(list_backups(second.backup_root)[0], extra)
    os.utime(extra / "manifest.json", (0, 0))
    manifest = json.loads((extra / "manifest.json").read_text())
    manifest["written_at"] = 1.0  # the oldest of the run
    (extra / "manifest.json").write_text(json.dumps(manifest))
    assert len(list_backups(second.backup_root)) == 3
    capsys.readouterr()
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=3,
                    overrides=every_step + ["backup.continue_last_backup=true"])
    out = capsys.readouterr().out
    # before: the first run's step-4 backup was taken (newest by step), max_steps counted as reached, nothing trained
    assert resumed.run_name == second.run_name and resumed.resumed_step == 2
    assert f"resuming run {second.run_name} from step 2, written at" in out
    assert resumed.progress.global_step == 3 and len(resumed.step_losses) == 1
    assert steps_of(list_backups(second.backup_root)) == [2, 3]
    assert steps_of(list_backups(first.backup_root)) == [3, 4]


def test_a_resume_that_trains_nothing_says_so_before_replacing_the_output(tiny_model, six_clips, tmp_path, capsys):
    first = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2)
    events = []
    capsys.readouterr()
    again = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
                  overrides=["backup.continue_last_backup=true"], on_update=events.append)
    out = capsys.readouterr().out
    assert again.run_name == first.run_name and not again.step_losses
    assert "no step was trained" in out and "replacing the existing" in out, out
    assert {"resumed_from": 2, "run": first.run_name, "backup": str(list_backups(first.backup_root)[-1])} in events


def test_backups_of_the_earlier_shared_layout_are_still_resumed(tiny_model, six_clips, tmp_path):
    first = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=["backup.every_n_steps=1"])
    # the layout of before: every run's step folders directly in <workspace>/backup
    base = tmp_path / "run" / "backup"
    for folder in list_backups(first.backup_root):
        shutil.move(str(folder), base / folder.name)
    first.backup_root.rmdir()
    choice = choose_backup(base)
    assert choice.run_name == first.run_name and choice.folder == base / "step-00000002"
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=3,
                    overrides=["backup.every_n_steps=1", "backup.rolling_count=1", "backup.continue_last_backup=true"])
    assert resumed.resumed_step == 2 and len(resumed.step_losses) == 1
    assert (base / "step-00000001").is_dir()  # an earlier version's backups are never pruned


# ---- damaged backups ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_step_run(tiny_model, six_clips, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    trainer = train(folder, tiny_model("wan2.1-t2v"), six_clips, steps=2, overrides=["backup.every_n_steps=1"])
    return folder, trainer


def flip_tensor_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header + 16, header + 80):  # 64 bytes of tensor data: size and header stay valid
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["bit flips", "manifest deleted"])
def test_a_damaged_or_unmanifested_backup_is_skipped_with_a_warning(damage, two_step_run, tiny_model, six_clips,
                                                                  tmp_path, capsys):
    folder, full = two_step_run
    shutil.copytree(folder / "run" / "backup", tmp_path / "run" / "backup")
    newest = tmp_path / "run" / "backup" / full.run_name / "step-00000002"
    if damage == "bit flips":
        flip_tensor_bytes(newest / "trainable.safetensors")
        assert not verify_backup(newest)  # the cheap check cannot see it: the checksums do
        assert any("does not match its checksum" in p for p in verify_backup(newest, checksums=True))
    else:
        (newest / "manifest.json").unlink()
    # the copied run wrote another folder's output: named, it is continued all the same
    resumed = train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
                    overrides=["backup.every_n_steps=1", "backup.continue_last_backup=true",
                               f"run_name={full.run_name}"])
    out = capsys.readouterr().out
    assert f"warning: backup {newest} is damaged and is skipped" in out, out
    # set aside, not left among the rolling backups: there it counted towards backup.rolling_count, so a resumed run
    # that had not reached its step again pruned the good older backups and kept the damaged one
    assert f"moved to {newest}.damaged" in out and (newest.parent / "step-00000002.damaged").is_dir()
    assert not verify_backup(newest, checksums=True)  # the step-2 backup the resumed run wrote
    assert resumed.resumed_step == 1
    assert resumed.step_losses == pytest.approx(full.step_losses[1:], abs=1e-6)  # step 2 trained again, the same


def test_a_run_whose_every_backup_is_damaged_is_not_restarted_over_its_output(two_step_run, tiny_model, six_clips,
                                                                                tmp_path):
    folder, full = two_step_run
    shutil.copytree(folder / "run", tmp_path / "run")
    for backup in (tmp_path / "run" / "backup" / full.run_name).glob("step-*"):
        flip_tensor_bytes(backup / "trainable.safetensors")
    # before: a warning, then a fresh run from step 0 that ended by replacing the output
    with pytest.raises(TrainingError, match=f"every backup of run {full.run_name} is damaged"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=2,
              overrides=["backup.continue_last_backup=true", f"run_name={full.run_name}"])
    assert sorted(p.name for p in (tmp_path / "run" / "backup" / full.run_name).iterdir()) == \
        ["step-00000001.damaged", "step-00000002.damaged"]


def test_a_resume_with_changed_lora_settings_names_them_and_keeps_the_runs_config(two_step_run, tiny_model,
                                                                                   six_clips, tmp_path):
    folder, full = two_step_run
    shutil.copytree(folder / "run", tmp_path / "run")
    recorded = tmp_path / "run" / "run-configs" / f"{full.run_name}.json"
    before = recorded.read_bytes()
    # before: a RuntimeError traceback from a tensor copy, and the run's recorded config rewritten with rank 16
    with pytest.raises(TrainingError, match=r"cannot resume from .*step-00000002: its trained tensors do not fit "
                                            r"this run .*lora.rank: 32 in the backup, 16 now"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=3,
              overrides=["lora.rank=16", "backup.continue_last_backup=true", f"run_name={full.run_name}"])
    assert recorded.read_bytes() == before


# ---- Ctrl-C ------------------------------------------------------------------------------------------------------

def cli(tmp_path: Path, base: Path, dataset: Path, *values: str) -> list[str]:
    values = [f"model.base_model_name={base}", f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}",
              f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu", "train_dtype=FLOAT_32",
              "gradient_checkpointing=false", "batch_size=4", f'data.concepts=[{{"path": "{dataset}"}}]',
              "data.frame_buckets=[9]", "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0",
              "tensorboard=false", *values]
    return [sys.executable, str(ROOT / "scripts" / "train.py")] + [a for v in values for a in ("--config-value", v)]


def test_ctrl_c_during_the_backup_before_the_save_finishes_it_and_stops_with_the_resume_command(
        tiny_model, six_clips, tmp_path):
    command = cli(tmp_path, tiny_model("wan2.1-t2v"), six_clips, "max_steps=2", "backup.every_n_steps=0")
    stopped = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, KILL_AT: "backup:1:INT"})
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    assert "finishing the backup before the final save first" in stopped.stdout
    assert "stopped; to resume, run:" in stopped.stdout
    backups = all_backups(tmp_path / "run" / "backup")
    assert steps_of(backups) == [2] and not verify_backup(backups[0], checksums=True)  # the run is not lost
    assert not (tmp_path / "out.safetensors").exists()
    resumed = subprocess.run(command + ["--config-value", "backup.continue_last_backup=true"], capture_output=True,
                             text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert load_file(str(tmp_path / "out.safetensors"))


# ---- the demo never writes into the user's folders ---------------------------------------------------------------

def run_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.mark.parametrize("path", ["my_clips_typo", "clips.jsonl", "empty_folder"])
def test_the_demo_preset_with_a_missing_or_empty_concept_is_a_config_error_and_writes_nothing(path, tmp_path):
    (tmp_path / "empty_folder").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = run_train("--preset-path", DEMO, "--config-value", f'data.concepts=[{{"path": "{path}"}}]',
                       "--config-value", "max_steps=3", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"data.concepts.0.path: {path!r}" in result.stderr
    assert "File exists" not in result.stderr
    assert "created only for the demo's own dataset" in result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_dataset_config_replaces_the_demo_concept():
    preset = json.loads(Path(DEMO).read_text())
    merged = merge_dataset_settings(preset, {"data": {"concepts": [{"name": "mine", "path": "/data/mine"}]}})
    assert [c["name"] for c in merged["data"]["concepts"]] == ["mine"]
    # a config's own concept stays beside the file's
    own = dict(preset, data=dict(preset["data"], concepts=[{"name": "own", "path": "/data/own"}]))
    merged = merge_dataset_settings(own, {"data": {"concepts": [{"name": "mine", "path": "/data/mine"}]}})
    assert [c["name"] for c in merged["data"]["concepts"]] == ["own", "mine"]


# ---- the end report ----------------------------------------------------------------------------------------------

def test_the_last_preview_is_the_highest_step_not_the_last_string_or_file(tmp_path):
    import os
    from modules.trainer.run_report import previews_by_step
    (tmp_path / "0-x").mkdir()
    (tmp_path / "1-y").mkdir()
    for index, name in enumerate(["0-x/200-33.mp4", "1-y/200-33.mp4", "0-x/50-8.mp4"]):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, ns=(index * 10**9, index * 10**9))   # 50-8 rendered last (a resume re-renders)
    assert [str(p.relative_to(tmp_path)) for p in previews_by_step(tmp_path)] == \
        ["0-x/50-8.mp4", "0-x/200-33.mp4", "1-y/200-33.mp4"]



def test_the_sample_line_names_an_a14b_pair_by_its_absolute_stem(tmp_path, monkeypatch):
    """A relative output: the pair's stem (which sample.py reads as `_high_noise` / `_low_noise`) is absolute as a
    single file's path is, so the printed command runs from any folder."""
    from modules.trainer.run_report import lora_to_sample
    (tmp_path / "out").mkdir()
    names = ["l_high_noise.safetensors", "l_low_noise.safetensors", "l_high_noise.diffusers.safetensors"]
    for name in names + ["one.safetensors", "one.diffusers.safetensors"]:
        (tmp_path / "out" / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert lora_to_sample([Path("out") / name for name in names]) == str(tmp_path / "out" / "l.safetensors")
    assert lora_to_sample([Path("out/one.safetensors"), Path("out/one.diffusers.safetensors")]) == \
        str(tmp_path / "out" / "one.safetensors")

# ---- a full cache folder -----------------------------------------------------------------------------------------

def test_a_full_cache_folder_is_one_line_naming_the_folder_and_entry(tiny_model, six_clips, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        (disk / "cache").mkdir()
        try:  # full to the last byte
            with open(disk / "filler", "wb", buffering=0) as filler:
                while True:
                    filler.write(b"\0" * 4096)
        except OSError:
            pass
        command = cli(tmp_path, tiny_model("wan2.1-t2v"), six_clips, "max_steps=1", f"cache_dir={disk / 'cache'}")
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    line = [line for line in result.stderr.splitlines() if line.startswith("train:")]
    assert len(line) == 1 and "writing the cache entry" in line[0] and str(disk / "cache") in line[0], result.stderr
    assert "No space left on device" in line[0]


# ---- values that passed the checks and crashed after the model loaded --------------------------------------------

@pytest.mark.parametrize("values, expected", [
    (["timestep.max_sigma=0"], "max_sigma (0) must be above min_sigma (0)"),
    (["timestep.min_sigma=0.5", "timestep.max_sigma=0.4"], "max_sigma (0.4) must be above min_sigma (0.5)"),
    (["optimizer.learning_rate=1e300"], "optimizer.learning_rate: 1e+300 is not allowed"),
    (["model.transformer.weight_dtype=FLOAT_8"], "FLOAT_8 weights are computed in bfloat16, but train_dtype is "
                                                 "FLOAT_32"),
    (["workspace_dir=/proc/x"], "workspace_dir: '/proc/x' cannot be created in '/proc'"),
])
def test_values_that_crashed_after_loading_are_config_errors(values, expected, tiny_model, six_clips, tmp_path):
    from modules.trainer.prepare import prepare_config
    overrides = [f"model.base_model_name={tiny_model('wan2.1-t2v')}", f'data.concepts=[{{"path": "{six_clips}"}}]',
                 f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}", "train_dtype=FLOAT_32",
                 f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu", *values]
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        prepare_config(load_config(overrides=overrides))


def test_an_a14b_expert_outside_the_sigma_range_is_a_config_error(tiny_model, six_clips, tmp_path):
    from modules.trainer.prepare import prepare_config
    base = tiny_model("wan2.2-t2v-a14b")
    config = load_config(overrides=[f"model.base_model_name={base}", "model_type=WAN_2_2", "expert=high",
                                    "timestep.max_sigma=0.5", f'data.concepts=[{{"path": "{six_clips}"}}]',
                                    f"workspace_dir={tmp_path / 'run'}", f"output.destination={tmp_path / 'o.st'}"])
    with pytest.raises(ConfigError, match=r"has no sigma in the high-noise expert's range"):
        prepare_config(config)


def test_a_dataset_config_that_cannot_be_read_is_a_config_error():
    from modules.util.config.dataset_toml import load_toml
    with pytest.raises(ConfigError, match="cannot be read"):
        load_toml("/proc/self/mem")


# ---- messages that misled ----------------------------------------------------------------------------------------

def test_a_folder_as_config_path_says_it_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; name the JSON file in it"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("name", ["exp/one", "..", "a\\b"])
def test_a_run_name_that_is_not_one_folder_name_is_a_config_error(name):
    # before: "exp/one" put the backups in backup/exp/one/, where no resume looks: continue_last_backup started fresh
    with pytest.raises(ConfigError, match=r"run_name: .* a run name is one folder name"):
        load_config(overrides=[f"run_name={name}"])


def test_a_bad_command_line_value_is_not_blamed_on_the_preset():
    # before: "invalid configuration in .../#demo tiny CPU.json", a file the user never edited
    with pytest.raises(ConfigError, match=r"invalid configuration in .*#demo tiny CPU.json \+ command-line values:"):
        load_config(preset_path=DEMO, overrides=["optimizer.learning_rate=1e300"])


def test_npz_headers_with_a_negative_size_or_an_absurd_fps_are_named(tmp_path):
    import numpy as np
    from modules.util.video_io import UnreadableMediaError, probe_media
    np.savez(tmp_path / "fast.npz", frames=np.zeros((9, 8, 8, 3), np.uint8), fps=np.array(1e12))
    with pytest.raises(UnreadableMediaError, match="frame rate is at most 240"):
        probe_media(tmp_path / "fast.npz")
    np.savez(tmp_path / "forged.npz", frames=np.zeros((2, 8, 8, 3), np.uint8))
    import zipfile
    with zipfile.ZipFile(tmp_path / "forged.npz") as archive:
        member = archive.read("frames.npy")
    forged = member.replace(b"(2, 8, 8, 3)", b"(-2, 8, 8, 3)" if b"(2, 8, 8, 3), " not in member else b"(-2,8, 8, 3)")
    with zipfile.ZipFile(tmp_path / "forged2.npz", "w") as archive:
        archive.writestr("frames.npy", forged)
    with pytest.raises(UnreadableMediaError, match="declares a negative size"):
        probe_media(tmp_path / "forged2.npz")


def test_tiny_repeats_are_named_when_nothing_is_left(tiny_model, six_clips, tmp_path):
    with pytest.raises(TrainingError, match=r"repeats 1e-300 keeps round\(items x repeats\)"):
        train(tmp_path, tiny_model("wan2.1-t2v"), six_clips, steps=1,
              overrides=[f'data.concepts=[{{"path": "{six_clips}", "repeats": 1e-300}}]'])


def test_a_config_without_an_enabled_concept_is_refused_before_loading(tiny_model, six_clips, tmp_path):
    """A shipped preset names no data: Start read the model (or tried to download it) and then said "no usable
    training item in (no enabled concept)"; it is a config error, found with the others."""
    from modules.trainer.prepare import prepare_config
    for concepts in ("[]", f'[{{"path": "{six_clips}", "enabled": false}}]'):
        config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}",
                                        f"data.concepts={concepts}", f"workspace_dir={tmp_path / 'r'}",
                                        f"output.destination={tmp_path / 'o.safetensors'}"])
        with pytest.raises(ConfigError) as error:
            prepare_config(config)
        assert [p.split(":")[0] for p in error.value.problems] == ["data.concepts"], error.value.problems
        assert "add your dataset folder as a concept" in error.value.problems[0]


def test_an_expert_on_a_one_transformer_model_is_noted(tiny_model, six_clips, tmp_path, caplog):
    from modules.trainer.prepare import prepare_config
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}", "expert=high",
                                    f'data.concepts=[{{"path": "{six_clips}"}}]', f"workspace_dir={tmp_path / 'r'}",
                                    f"output.destination={tmp_path / 'o.safetensors'}"])
    prepare_config(config)
    assert any("expert applies to Wan 2.2 A14B only and is ignored" in r.getMessage() for r in caplog.records)
