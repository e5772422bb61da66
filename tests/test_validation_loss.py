"""Issue 22 item 1: the validation loss. Held-out files never reach a training batch; an evaluation is a function of
the weights alone (bit-equal twice, different after a step, the same on 1 and 2 ranks); a run that learns has a
falling validation loss, and validation.keep_best keeps the step with the lowest one."""
import json
import shutil

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learning import train
from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.dataLoader.concept_scan import scan_concepts
from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.dataLoader.pipeline.RankBucketBatch import RankBucketBatch
from modules.dataLoader.validation_split import held_out_count, split_validation
from modules.trainer.ValidationEvaluator import BEST_FOLDER, RESULT_FILE, validation_sigmas
from modules.trainer.backup_io import read_backup
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.OptimizerConfig import TimestepConfig
from test_multi_gpu import run_ranks

EVERY = 3
STEPS = 12
VALIDATION = ["data.validation_split=0.25", f"validation.every_n_steps={EVERY}", "validation.keep_best=true",
              "tensorboard=true"]


def loader(dataset, *values: str) -> WanBaseDataLoader:
    config = load_config(overrides=[f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]",
                                    "data.resolution=32", "data.aspect_ratios=[1.0]", "batch_size=4", *values])
    data = WanBaseDataLoader(config)
    data.scan()
    return data


def test_held_out_files_are_chosen_by_file_and_never_trained_on(squares_dataset):
    data = loader(squares_dataset, "data.validation_split=0.25")
    held_out = {r["path"] for r in data.validation_records}
    assert len(held_out) == held_out_count(24, 0.25) == 6
    # the same files whatever the seed or the order of the scan (a hash of the path inside the concept)
    other = loader(squares_dataset, "data.validation_split=0.25", "seed=7")
    assert {r["path"] for r in other.validation_records} == held_out
    records = scan_concepts(data.config.data.concepts).records
    _, validation = split_validation(list(reversed(records)), data.config.data)
    assert {r["path"] for r in validation} == held_out
    # every training batch of several epochs: no held-out file, and every other file in each epoch
    pipeline = Pipeline(data._item_modules() + [RankBucketBatch(["path"], 4)], data.config.seed)
    seen_held_out, seen = 0, set()
    for epoch in range(3):
        for batch in pipeline.iterate(epoch):
            seen_held_out += sum(path in held_out for path in batch["path"])
            seen |= set(batch["path"])
    assert seen_held_out == 0
    assert len(seen) == 18 and not seen & held_out

def test_a_concept_marked_validation_is_held_out_whole(squares_dataset, tmp_path):
    held = tmp_path / "held"
    held.mkdir()
    for clip in sorted(squares_dataset.glob("red_*.mp4"))[:3]:
        shutil.copy(clip, held / clip.name)
        shutil.copy(clip.with_suffix(".txt"), held / clip.with_suffix(".txt").name)
    marked = loader(squares_dataset, f'data.concepts=[{{"path": "{squares_dataset}"}}, {{"path": "{held}", '
                                     f'"validation": true, "caption_dropout": 0.5}}]')
    assert sorted(r["path"] for r in marked.validation_records) == sorted(str(p) for p in held.glob("*.mp4"))
    assert len(marked.scan_result.records) == 24
    assert all(r["concept"].caption_dropout == 0 for r in marked.validation_records)  # the caption always counts
    # a file listed by a validation concept is never trained on, even where another concept lists it too
    both = loader(squares_dataset, f'data.concepts=[{{"path": "{squares_dataset}"}}, '
                                   f'{{"path": "{squares_dataset}", "validation": true}}, {{"path": "{held}"}}]')
    assert {r["path"] for r in both.scan_result.records} == {str(p) for p in held.glob("*.mp4")}


def test_sigmas_are_quantiles_of_the_training_distribution_in_the_experts_range():
    uniform = TimestepConfig(distribution="uniform")
    assert validation_sigmas(uniform, 5, 0.0, 1.0, True) == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9], abs=0.01)
    # the high-noise expert of an A14B model (boundary 0.875): all sigmas in its range, spread over it
    high = validation_sigmas(TimestepConfig(), 4, 0.875, 1.0, True)
    assert all(0.875 <= s <= 1.0 for s in high) and high == sorted(high) and len(set(high)) == 4
    low = validation_sigmas(TimestepConfig(), 4, 0.0, 0.875, False)
    assert all(s < 0.875 for s in low)


@pytest.mark.parametrize("expert", ["both", "high"])
def test_a14b_sigmas_cover_the_trained_experts_range_each_by_its_expert(tiny_model, squares_dataset, tmp_path,
                                                                          expert):
    trainer = train(tmp_path, tiny_model("wan2.2-t2v-a14b"), squares_dataset, steps=1,
                    overrides=["data.validation_split=0.25", f"expert={expert}", "validation.before_training=false"])
    boundary, sigmas = trainer.model.boundary_ratio, trainer.validation.sigmas
    calls = {"transformer": 0, "transformer_2": 0}
    def counter(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)
    for name in trainer.setup.experts_in_training():
        getattr(trainer.model, name).register_forward_hook(counter(name))
    trainer.validation.evaluate()
    batches = trainer.validation.batch_count
    high = sum(s >= boundary for s in sigmas)
    if expert == "high":
        assert high == len(sigmas) and calls == {"transformer": batches * len(sigmas), "transformer_2": 0}
    else:  # both: the whole schedule, each sigma by the expert that denoises there
        assert 0 < high < len(sigmas)
        assert calls == {"transformer": batches * high, "transformer_2": batches * (len(sigmas) - high)}


@pytest.fixture(scope="module")
def validated_run(tiny_model, squares_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validated")
    events = []
    trainer = train(tmp, tiny_model("wan2.1-t2v"), squares_dataset, steps=STEPS,
                    overrides=VALIDATION + ["optimizer.learning_rate=0.001"], on_update=events.append)
    trainer.events = events
    return tmp, trainer


def tensorboard_scalars(trainer, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(trainer.tensorboard_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_the_runs_training_batches_hold_no_validation_item(validated_run):
    _, trainer = validated_run
    data = trainer.data
    held_out = {r["path"] for r in data.validation_records}
    batcher = data.pipeline.modules[-1]  # the run's own RankBucketBatch
    paths = Pipeline(data._item_modules(), data.config.seed, outputs=["path"])  # its input items, by index
    counted = {"held_out": 0, "trained": 0}
    for epoch in range(2):
        data.pipeline.start_epoch(epoch)
        paths.start_epoch(epoch)
        for index in range(len(data.pipeline)):
            for member in batcher.upstream_indices(index):
                counted["held_out" if paths.get_item(member)["path"] in held_out else "trained"] += 1
    assert counted == {"held_out": 0, "trained": 2 * 18}
    # and the evaluator's items are exactly the held-out files
    evaluator = trainer.validation
    items = Pipeline(data._item_modules(validation=True), data.config.seed, outputs=["path"])
    items.start_epoch(0)
    assert evaluator.item_count == len(items) == 6
    assert {items.get_item(i)["path"] for i in range(len(items))} == held_out


def test_an_evaluation_depends_only_on_the_weights(validated_run):
    _, trainer = validated_run
    history = trainer.validation.history
    assert [r.step for r in history] == [0, 3, 6, 9, 12]
    # the final weights evaluated again, twice: bit for bit what the run logged at its end
    first, second = trainer.validation.evaluate(), trainer.validation.evaluate()
    assert first.loss == second.loss == history[-1].loss
    assert first.per_sigma == second.per_sigma == history[-1].per_sigma
    # a step changes the weights, so the value
    assert len({r.loss for r in history}) == len(history)
    # the evaluations draw nothing from the training's random streams: the run trains as one that evaluates only
    # after its last step
    tmp = validated_run[0]
    plain = train(tmp / "plain", trainer.config.model.base_model_name, trainer.config.data.concepts[0].path,
                  steps=STEPS, overrides=["data.validation_split=0.25", "validation.before_training=false",
                                          "optimizer.learning_rate=0.001"])
    assert plain.step_losses == trainer.step_losses


def test_an_evaluation_leaves_every_modules_mode_as_it_was(validated_run):
    # a submodule kept in eval mode on purpose stays so (a blanket train() afterwards would turn it on)
    _, trainer = validated_run
    transformer = trainer.model.transformer
    transformer.blocks[0].eval()
    before = {name: module.training for name, module in transformer.named_modules()}
    try:
        trainer.validation.evaluate()
        assert {name: module.training for name, module in transformer.named_modules()} == before
    finally:
        transformer.train()


def test_it_runs_under_the_memory_switches_with_the_same_value(validated_run, tiny_model, squares_dataset):
    tmp, trainer = validated_run
    swapped = train(tmp / "swapped", tiny_model("wan2.1-t2v"), squares_dataset, steps=1,
                    overrides=["data.validation_split=0.25", "performance.block_swap=1", "gradient_checkpointing=true",
                               "performance.attention=math", "validation.batch_size=3"])
    # the base weights before the first step: the same value in other batches, with a block swapped and checkpointed
    assert swapped.validation.history[0].step == 0
    assert swapped.validation.history[0].loss == pytest.approx(trainer.validation.history[0].loss, rel=1e-6)


def test_the_validation_loss_falls_and_keep_best_keeps_the_lowest(validated_run):
    _, trainer = validated_run
    logged = tensorboard_scalars(trainer, "validation/loss")
    assert sorted(logged) == [0, 3, 6, 9, 12]
    assert logged[12] < logged[0]
    assert logged == pytest.approx({r.step: r.loss for r in trainer.validation.history}, rel=1e-6)
    per_sigma = [tag for tag in EventAccumulator(str(trainer.tensorboard_dir)).Reload().Tags()["scalars"]
                 if tag.startswith("validation/loss_sigma_")]
    assert len(per_sigma) == 5
    # best/ holds the lowest trained step (step 0 is the base model)
    trained = {step: value for step, value in logged.items() if step > 0}
    lowest_step = min(trained, key=trained.get)
    best = trainer.backup_root / BEST_FOLDER
    recorded = json.loads((best / RESULT_FILE).read_text())
    assert recorded["step"] == lowest_step and recorded["loss"] == pytest.approx(logged[lowest_step], rel=1e-6)
    state = read_backup(best)
    assert state["progress"].global_step == lowest_step
    # the kept weights give the kept value, bit for bit
    trainer.setup.load_trainable_state_dict(state["trainable"])
    assert trainer.validation.evaluate().loss == recorded["loss"]
    # rolling pruning leaves it alone; the end report names it
    assert best.is_dir()
    assert f"lowest validation loss at step {lowest_step}" in trainer.validation.end_line([])


def test_the_gui_gets_every_value_beside_the_training_losses(validated_run, tmp_path):
    from modules.ui.TrainController import TrainController
    _, trainer = validated_run
    controller = TrainController(last_used=tmp_path / "last-used.json")
    controller.trainer = trainer
    for event in trainer.events:  # what the worker thread would have passed on, in order
        controller._on_update(event)
    kinds = [kind for kind, _ in controller.poll_events()]
    assert kinds.count("validation") == 5 and kinds.count("progress") == STEPS
    assert controller.run.validation_losses == [(r.step, r.loss) for r in trainer.validation.history]
    assert len(controller.run.losses) == STEPS


def test_keep_best_keeps_the_lowest_not_the_latest(validated_run):
    _, trainer = validated_run
    best = trainer.backup_root / BEST_FOLDER
    before = json.loads((best / RESULT_FILE).read_text())
    kept = read_backup(best)["trainable"]
    # worse weights at a later step: the up matrices turned against what they learned, the value rises, best/ stays
    saved = trainer.setup.trainable_state_dict()
    worse = {name: value * (-3 if ".lora_B." in name else 1) for name, value in saved.items()}
    trainer.setup.load_trainable_state_dict(worse)
    trainer.progress.global_step += 1
    try:
        result = trainer.validation.run()
    finally:
        trainer.setup.load_trainable_state_dict(saved)
        trainer.progress.global_step -= 1
        trainer.validation.history.pop()
    assert result.loss > before["loss"]
    assert json.loads((best / RESULT_FILE).read_text()) == before
    assert all(torch.equal(kept[k], v) for k, v in read_backup(best)["trainable"].items())


def test_a_resumed_run_keeps_its_values_and_its_best(validated_run, tiny_model, squares_dataset):
    tmp, trainer = validated_run
    resumed_dir = tmp / "resumed"
    shutil.copytree(tmp / "run", resumed_dir / "run")  # the whole workspace: backups, best/, logs, history
    resumed = train(resumed_dir, tiny_model("wan2.1-t2v"), squares_dataset, steps=STEPS + EVERY,  # named: its output
                    overrides=VALIDATION + ["optimizer.learning_rate=0.001", "backup.continue_last_backup=true",
                                            f"run_name={trainer.run_name}"])
    history = resumed.validation.history
    assert [r.step for r in history] == [0, 3, 6, 9, 12, 15]
    assert history[:5] == trainer.validation.history  # read back from <workspace>/validation/<run>.json
    written = json.loads(resumed.validation.history_file.read_text())
    assert [row["step"] for row in written] == [0, 3, 6, 9, 12, 15]
    trained = [r for r in history if r.step > 0]
    lowest = min(trained, key=lambda r: r.loss)
    best = json.loads((resumed.backup_root / BEST_FOLDER / RESULT_FILE).read_text())
    assert best["step"] == lowest.step and best["loss"] == lowest.loss
    assert f"lowest validation loss at step {lowest.step}" in resumed.validation.end_line([])


def test_the_best_backup_saves_as_docs_validation_md_says(validated_run, tiny_model, squares_dataset):
    tmp, trainer = validated_run
    best = trainer.backup_root / BEST_FOLDER
    step = json.loads((best / RESULT_FILE).read_text())["step"]
    export = tmp / "best-export"
    shutil.copytree(best, export / "run" / "backup" / f"step-{step:08d}")
    saved = train(export, tiny_model("wan2.1-t2v"), squares_dataset, steps=step,  # the run's config names the run
                  overrides=VALIDATION + ["optimizer.learning_rate=0.001", "backup.continue_last_backup=true",
                                          f"run_name={trainer.run_name}"])
    assert saved.step_losses == []  # nothing trained: only saved
    kept = read_backup(best)["trainable"]
    now = saved.setup.trainable_state_dict()
    assert kept.keys() == now.keys() and all(torch.equal(kept[k], now[k]) for k in kept)
    assert (export / "out.safetensors").is_file()


@pytest.mark.parametrize("method", ["LORA", "FINE_TUNE"])
def test_the_same_value_on_one_and_two_ranks(tiny_model, squares_dataset, tmp_path, method):
    # validation batches of 2: 3 batches of the 6 held-out items, dealt out 2 + 1 to the ranks (DDP: rank 1 runs
    # one; a sharded FSDP2 fine-tune needs both in every forward pass: rank 1 runs a copy it does not count), and
    # keep_best's backup is a collective
    overrides = ["optimizer.learning_rate=0.0001", "data.validation_split=0.25", "validation.every_n_steps=2",
                 "validation.batch_size=2", "validation.keep_best=true"]
    single = train(tmp_path / "single", tiny_model("wan2.1-t2v"), squares_dataset, method=method, steps=2,
                   overrides=overrides + ["batch_size=2"])
    ranks = run_ranks(tmp_path / "ranks", tiny_model("wan2.1-t2v"), squares_dataset, overrides + ["batch_size=1"],
                      method=method, steps=2)
    expected = [[r.step, r.loss] for r in single.validation.history]
    assert [step for step, _ in expected] == [0, 2]
    assert ranks[0]["validation"] == ranks[1]["validation"]  # every rank holds the reduced value
    # before training the weights are equal: the split and the reduction are exact
    assert ranks[0]["validation"][0] == expected[0]
    for (step, loss), (expected_step, expected_loss) in zip(ranks[0]["validation"], expected):
        assert step == expected_step and loss == pytest.approx(expected_loss, abs=1e-6)


@pytest.mark.parametrize("value, field", [("validation.timesteps=0", "validation.timesteps"),
                                          ("validation.every_n_steps=-1", "validation.every_n_steps"),
                                          ("data.validation_split=1", "data.validation_split"),
                                          ("data.validation_split=NaN", "data.validation_split")])
def test_bad_values_are_refused(value, field):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[value])
    assert [p.split(":")[0] for p in error.value.problems] == [field]


def test_no_training_item_left_names_the_held_out_files(squares_dataset):
    from modules.dataLoader.WanBaseDataLoader import DataError
    with pytest.raises(DataError, match="24 files are held out for the validation loss"):
        loader(squares_dataset, f'data.concepts=[{{"path": "{squares_dataset}", "validation": true}}]')
