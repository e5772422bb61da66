"""Issue 22 item 3: LoRA+ (the B matrices at `lora.plus_lr_ratio` x the learning rate) and a fine-tune's per-part
learning rates, as optimizer parameter groups that a resume restores."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from learning import train
from modules.trainer.GenericTrainer import TrainingError
from modules.trainer.parameter_groups import fine_tune_part, parameter_groups
from modules.util.config.config_io import ConfigError, load_config
from modules.util.tiny_models import SPECS, make_transformer

LR, RATIO = 1e-3, 16.0
COMMON = [f"optimizer.learning_rate={LR}", f"lora.plus_lr_ratio={RATIO}", "backup.every_n_steps=2",
          "batch_size=2"]


def group_names(trainer) -> dict[str, list[str]]:
    """Each parameter group's name -> the names of its parameters."""
    names = {id(p): n for n, p in trainer.setup.named_trainable_parameters()}
    return {g["name"]: [names[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups}


@pytest.fixture(scope="module")
def lora_plus_run(tiny_model, squares_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_plus")
    return tmp, train(tmp / "full", tiny_model("wan2.1-t2v"), squares_dataset, steps=4, overrides=COMMON)


def test_lora_b_matrices_learn_at_ratio_times_the_rate(lora_plus_run):
    _, trainer = lora_plus_run
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert set(groups) == {"base", "lora_B"}
    assert groups["lora_B"]["lr"] == pytest.approx(RATIO * LR) and groups["base"]["lr"] == pytest.approx(LR)
    names = group_names(trainer)
    assert names["lora_B"] and all(".lora_B." in n for n in names["lora_B"])
    assert names["base"] and not any(".lora_B." in n for n in names["base"])
    # every trained tensor is in exactly one group
    assert sorted(names["base"] + names["lora_B"]) == sorted(n for n, _ in trainer.setup.named_trainable_parameters())


def test_resume_keeps_the_groups_and_continues_identically(lora_plus_run, tiny_model, squares_dataset):
    tmp, full = lora_plus_run
    resumed_dir = tmp / "resumed"
    shutil.copytree(full.backup_root / "step-00000002", resumed_dir / "run" / "backup" / "step-00000002")
    # the resumed run is given another ratio: the backup's groups and rates win, as its single rate always did
    resumed = train(resumed_dir, tiny_model("wan2.1-t2v"), squares_dataset, steps=4,
                    overrides=COMMON + ["backup.continue_last_backup=true", "lora.plus_lr_ratio=2",
                                        f"run_name={full.run_name}"])
    groups = {g["name"]: g["lr"] for g in resumed.optimizer.param_groups}
    assert groups == pytest.approx({"base": LR, "lora_B": RATIO * LR})
    assert resumed.step_losses == full.step_losses[2:]
    a, b = load_file(str(tmp / "full" / "out.safetensors")), load_file(str(resumed_dir / "out.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_backup_with_other_groups_is_refused_naming_both(lora_plus_run, tiny_model, squares_dataset):
    tmp, full = lora_plus_run
    plain_dir = tmp / "plain"
    shutil.copytree(full.backup_root / "step-00000002", plain_dir / "run" / "backup" / "step-00000002")
    # the run's saved config (the one its end report's "train on" command names) is there before the attempt
    run_config = plain_dir / "run" / "run-configs" / f"{full.run_name}.json"
    run_config.parent.mkdir(parents=True)
    shutil.copy(full.workspace / "run-configs" / f"{full.run_name}.json", run_config)
    before = run_config.read_bytes()
    with pytest.raises(TrainingError, match=r"parameter groups \['base', 'lora_B'\], this run has \['all'\]"):
        train(plain_dir, tiny_model("wan2.1-t2v"), squares_dataset, steps=4,
              overrides=COMMON + ["backup.continue_last_backup=true", "lora.plus_lr_ratio=1",
                                  f"run_name={full.run_name}"])
    # a refused resume leaves it as it was: rewritten, it held the refused settings and the printed command to
    # train on failed the same way
    assert run_config.read_bytes() == before
    assert [p.name for p in run_config.parent.iterdir()] == [run_config.name]


def test_fine_tune_parts_get_their_own_rates():
    transformer = make_transformer(SPECS["wan2.1-i2v"], seed=0)
    named = [(f"transformer.{n}", p) for n, p in transformer.named_parameters()]
    config = load_config(overrides=["training_method=FINE_TUNE", "optimizer.learning_rate=0.0001",
                                    "fine_tune.embeddings_learning_rate=0.001", "fine_tune.heads_learning_rate=0.01"])
    groups = {g["name"]: g for g in parameter_groups(config, named)}
    assert {name: g["lr"] for name, g in groups.items()} == {"blocks": 1e-4, "embeddings": 1e-3, "heads": 1e-2}
    parts = {n: fine_tune_part(n) for n, _ in named}
    assert parts["transformer.patch_embedding.weight"] == "embeddings"
    assert parts["transformer.condition_embedder.image_embedder.ff.net.0.proj.weight"] == "embeddings"
    assert parts["transformer.scale_shift_table"] == parts["transformer.proj_out.weight"] == "heads"
    assert parts["transformer.blocks.1.attn2.to_k.weight"] == "blocks"
    assert sum(len(g["params"]) for g in groups.values()) == len(named)  # nothing left out
    # no per-part rate: one group, as before groups existed
    plain = parameter_groups(load_config(overrides=["training_method=FINE_TUNE"]), named)
    assert [g["name"] for g in plain] == ["all"]


@pytest.mark.parametrize("values, field", [
    (["lora.type=LOHA", "lora.plus_lr_ratio=4"], "lora"),
    (["lora.plus_lr_ratio=0.5"], "lora.plus_lr_ratio"),
    (["lora.plus_lr_ratio=NaN"], "lora.plus_lr_ratio"),
    (["fine_tune.blocks_learning_rate=0"], "fine_tune.blocks_learning_rate"),
])
def test_bad_values_are_refused_before_loading(values, field):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=values)
    assert any(p.startswith(field) for p in error.value.problems), error.value.problems
