import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.util.config.config_io import (CONFIG_VERSION, ConfigError, config_to_dict, load_config, save_config)
from modules.util.config.TrainConfig import TrainConfig
from modules.util.config.validation import check_paths
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.TrainingMethod import TrainingMethod

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_round_trip_keeps_every_value(tmp_path):
    config = TrainConfig(training_method=TrainingMethod.FINE_TUNE, epochs=3, seed=7)
    config.lora.rank = 8
    config.output.format = ModelFormat.KOHYA_LORA
    config.data.frame_buckets = [1, 33]
    save_config(config, tmp_path / "c.json")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["__version"] == CONFIG_VERSION
    loaded = load_config(str(tmp_path / "c.json"))
    assert loaded == config
    assert config_to_dict(loaded) == saved


def test_preset_then_config_then_overrides(tmp_path):
    preset = write(tmp_path / "preset.json", {"lora": {"rank": 16, "alpha": 16}, "epochs": 5})
    cfg = write(tmp_path / "c.json", {"__version": 1, "epochs": 6, "optimizer": {"learning_rate": 2e-4}})
    config = load_config(str(cfg), str(preset), ["lora.rank=4", "optimizer.optimizer=ADAMW_8BIT",
                                                 "data.frame_buckets=[1, 17]", "model.base_model_name=some/dir"])
    assert config.lora.rank == 4 and config.lora.alpha == 16       # override wins, preset kept
    assert config.epochs == 6                                        # config file over preset
    assert config.optimizer.learning_rate == 2e-4
    assert config.optimizer.optimizer == "ADAMW_8BIT"
    assert config.data.frame_buckets == [1, 17]
    assert config.model.base_model_name == "some/dir"                # a non-JSON value stays a string
    assert config.batch_size == TrainConfig().batch_size             # untouched default


def test_every_shipped_preset_loads():
    presets = sorted((ROOT / "training_presets").glob("*.json"))
    for preset in presets:
        load_config(preset_path=str(preset))


def test_unversioned_config_is_migrated(tmp_path):
    old = write(tmp_path / "old.json", {"output_model_destination": "x.safetensors", "output_model_format": "KOHYA_LORA"})
    config = load_config(str(old))
    assert config.output.destination == "x.safetensors" and config.output.format is ModelFormat.KOHYA_LORA


@pytest.mark.parametrize("overrides, expected", [
    (["lora.rnak=4"], "lora.rnak: unknown key"),
    (["epochs=many"], "epochs: 'many' is not allowed"),
    (["lora.rank=0"], "lora.rank: 0 is not allowed: Input should be greater than or equal to 1"),
    (["optimizer.optimizer=SGD"], "optimizer.optimizer: 'SGD' is not allowed"),
    (["data.frame_buckets=[1, 16]"], "data.frame_buckets: [1, 16] is not allowed"),
    (["training_method=DREAMBOOTH"], "training_method: 'DREAMBOOTH' is not allowed"),
])
def test_bad_values_name_field_and_value(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert any(problem.startswith(expected) for problem in error.value.problems), error.value.problems


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["lora.rank=0", "epochs=0", "bogus=1"])
    assert len(error.value.problems) == 3


def test_missing_files_are_reported(tmp_path):
    config = load_config(overrides=[f"model.base_model_name={tmp_path / 'nope'}",
                                    f"data.concepts=[{{\"path\": \"{tmp_path / 'missing'}\"}}]"])
    with pytest.raises(ConfigError) as error:
        check_paths(config)
    text = "\n".join(error.value.problems)
    assert "model.base_model_name" in text and "data.concepts.0.path" in text


def test_malformed_json_names_the_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"epochs": 3,\n "lora": }')
    with pytest.raises(ConfigError) as error:
        load_config(str(bad))
    assert "line 2" in error.value.problems[0] and str(bad) in str(error.value)


@pytest.mark.parametrize("args, expected", [
    (["--config-value", "lora.rank=-1"], "lora.rank"),
    (["--config-path", "/nonexistent/config.json"], "does not exist"),
    (["--config-value", "model.base_model_name=/nonexistent/model"], "model.base_model_name"),
])
def test_train_script_exits_2_before_loading_a_model(args, expected):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
