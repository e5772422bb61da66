"""A VACE run with controls, masks and references resumes from its backup exactly, and its validation loss on
held-out clips is computed with those clips' own controls."""
import shutil

import pytest

from learning import assert_resumed_identically, train
from test_vace_training import vace_dataset


def test_a_vace_lora_run_resumes_from_its_backup_identically(tiny_model, tmp_path):
    base = tiny_model("wan2.1-vace")
    data = vace_dataset(tmp_path / "data")
    # 4 clips / batch 2 = 2 batches an epoch: step 3 is mid-epoch, so the data position matters
    common = ["optimizer.learning_rate=0.01", "lora.rank=4", "lora.targets=vace", "batch_size=2",
              "backup.every_n_steps=3", "data.concepts.0.seed=3"]
    full = train(tmp_path / "full", base, data, steps=4, overrides=common)
    first = train(tmp_path / "split", base, data, steps=3, overrides=common)
    resumed = train(tmp_path / "split", base, data, steps=4, overrides=common + ["backup.continue_last_backup=true"])
    assert_resumed_identically(full, first, resumed, 4)


def test_the_validation_loss_uses_each_held_out_clips_own_control(tiny_model, tmp_path):
    """The same weights, targets, masks and references, only the controls moved one clip along: the validation
    value before training differs; a validation that dropped the control would give the same value twice."""
    base = tiny_model("wan2.1-vace")
    own = vace_dataset(tmp_path / "own")
    moved = tmp_path / "moved"
    shutil.copytree(own, moved)
    for i in range(4):
        shutil.rmtree(moved / f"clip_{i}_control")
        shutil.copytree(own / f"clip_{(i + 1) % 4}_control", moved / f"clip_{i}_control")
    overrides = ["lora.targets=vace", "data.validation_split=0.25", "validation.every_n_steps=100"]
    values = []
    for name, data in (("own", own), ("moved", moved)):
        trainer = train(tmp_path / f"run-{name}", base, data, steps=1, overrides=overrides)
        assert trainer.validation.history[0].step == 0
        values.append(trainer.validation.history[0].loss)
    assert values[0] != pytest.approx(values[1], rel=1e-4)
