"""Settings that once failed after the model loaded, or were ignored without a word, through scripts/train.py:
`fine_tune.layer_filter` matching nothing (a ValueError traceback after loading) and an absurd
`distributed.timeout_minutes` (an OverflowError or a 0 ms network error in every rank) exit 2 before any model loads;
`distributed.shard_base=true` on one process, `data.control.derive` and a concept's `control_path` on a model without
control input are named as ignored. Each test failed before the change."""
import logging
from pathlib import Path

import pytest

from tests.script_loader import load_script

train_script = load_script("train")


def run_train(tmp_path: Path, base: Path, data: Path, *values: str, plan: bool = False) -> int:
    common = [f"model.base_model_name={base}", f'data.concepts=[{{"path": "{data}"}}]',
              f"workspace_dir={tmp_path / 'run'}", f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu",
              "train_dtype=FLOAT_32", "max_steps=1", "data.frame_buckets=[9]", "data.resolution=32",
              "data.aspect_ratios=[1.0]", "data.dataloader_threads=0"]
    argv = [arg for value in common + list(values) for arg in ("--config-value", value)]
    return train_script.main(argv + (["--plan"] if plan else []))


def test_a_layer_filter_matching_nothing_exits_2_before_loading(tiny_model, squares_dataset, tmp_path, capsys,
                                                                no_model_loads):
    code = run_train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, "training_method=FINE_TUNE",
                     "output.format=ORIGINAL", 'fine_tune.layer_filter=["blocks.99.", "atn1"]')
    error = capsys.readouterr().err
    assert code == 2, error
    assert "fine_tune.layer_filter: ['blocks.99.', 'atn1'] matches no parameter of the transformer" in error, error
    assert "Traceback" not in error


def test_a_two_expert_fine_tune_of_both_experts_exits_2_before_loading(tiny_model, squares_dataset, tmp_path, capsys,
                                                                      no_model_loads):
    code = run_train(tmp_path, tiny_model("wan2.2-t2v-a14b"), squares_dataset, "model_type=WAN_2_2",
                     "training_method=FINE_TUNE", "output.format=ORIGINAL", "expert=both")
    error = capsys.readouterr().err
    assert code == 2, error
    assert "expert: a fine-tune trains one expert of a two-expert model; set expert to high or low" in error, error
    assert "Traceback" not in error


def test_a_layer_filter_that_matches_is_accepted(tiny_model, squares_dataset, tmp_path):
    from modules.trainer.prepare import prepare_config
    from modules.util.config.config_io import load_config
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}", "training_method=FINE_TUNE",
                                    "output.format=ORIGINAL", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
                                    f"workspace_dir={tmp_path / 'run'}", f"output.destination={tmp_path / 'o.st'}",
                                    'fine_tune.layer_filter=["blocks.1.attn1"]'])
    prepare_config(config)


@pytest.mark.parametrize("minutes", ["1e308", "1e-300", "0.5", "20000"])
def test_a_timeout_outside_its_range_exits_2(tiny_model, squares_dataset, tmp_path, capsys, no_model_loads, minutes):
    code = run_train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, f"distributed.timeout_minutes={minutes}")
    error = capsys.readouterr().err
    assert code == 2, error
    assert "distributed.timeout_minutes: " in error and ("less than or equal to 10080" in error
                                                         or "greater than or equal to 1" in error), error


def test_inapplicable_settings_are_named_in_the_plan(tiny_model, squares_dataset, tmp_path, caplog):
    (tmp_path / "controls").mkdir()
    with caplog.at_level(logging.WARNING):
        code = run_train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, "distributed.shard_base=true",
                         "data.control.derive=canny", f"data.concepts.0.control_path={tmp_path / 'controls'}",
                         plan=True)
    assert code == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("distributed.shard_base: true splits the frozen base over several processes, but this "
                            "run has one process") and "ignored" in m for m in messages), messages
    assert any(m.startswith("data.control.derive=canny is set, but") and "takes no control video" in m
               and "ignored" in m for m in messages), messages
    assert any(m.startswith("data.concepts.0.control_path is set, but") and "ignored" in m for m in messages), messages
