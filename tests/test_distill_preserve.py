"""`distill.mode` "preserve" (docs/distilled.md, modules/modelSetup/distill_preserve.py): the LoRA trains with the
accelerator attached and frozen plus a teacher-matching term; the saved LoRA holds the user's adapter only, the base
is left bit-identical, a run resumes bit-identically, and config errors stop before any model loads."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from learning import assert_resumed_identically, train
from modules.modelSampler.accelerator import accelerated, load_accelerator
from modules.util.config.AcceleratorConfig import AcceleratorConfig
from test_accelerator import _accelerator_parts, _write, load

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def accelerator_file(tiny_model, tmp_path_factory):
    """A fixture accelerator for the tiny model: low-rank modules on attention and FFN plus full deltas."""
    base = tiny_model("wan2.1-t2v")
    return _write(tmp_path_factory.mktemp("accelerator") / "accelerator.safetensors",
                  *_accelerator_parts(load(base).transformer, 4), "lightx2v")


def _preserve(accelerator_file, weight: float = 0.5) -> list[str]:
    return ["optimizer.learning_rate=0.01", "distill.mode=preserve", f"distill.preserve_weight={weight}",
            f'sampling.accelerator={{"file": "{accelerator_file}", "strength": 1.0}}']


def test_preserve_trains_beside_the_frozen_accelerator_and_saves_only_the_users_lora(tiny_model, squares_dataset,
                                                                                    accelerator_file, tmp_path, capsys):
    """The first step's loss is the data loss of base + accelerator (the LoRA starts at zero, so the teacher term
    is 0 and the weight does not matter yet), unlike the base's; after it the teacher term acts. The trained
    transformer's base weights stay bit-identical, and the file holds the same keys as a `base` run's."""
    base = tiny_model("wan2.1-t2v")
    plain = train(tmp_path / "base", base, squares_dataset, steps=3, overrides=["optimizer.learning_rate=0.01"])
    capsys.readouterr()
    preserved = train(tmp_path / "preserve", base, squares_dataset, steps=3, overrides=_preserve(accelerator_file))
    assert f"distill: preserve: trains on the accelerator {accelerator_file} attached (frozen, strength 1); teacher " \
           f"matching weight 0.5" in capsys.readouterr().out
    unweighted = train(tmp_path / "weight0", base, squares_dataset, steps=3,
                       overrides=_preserve(accelerator_file, 0.0))
    assert preserved.step_losses[0] == unweighted.step_losses[0] != plain.step_losses[0]
    assert preserved.step_losses[1:] != unweighted.step_losses[1:]

    fresh = load(base).transformer.state_dict()
    trained = {name.replace("base_layer.", ""): value for name, value in
               preserved.model.transformer.state_dict().items() if "lora_" not in name}
    assert fresh.keys() == trained.keys()
    assert all(torch.equal(trained[name], fresh[name]) for name in fresh)

    def keys(path):
        with safe_open(str(path), "pt") as file:
            return set(file.keys())
    assert keys(tmp_path / "preserve" / "out.safetensors") == keys(tmp_path / "base" / "out.safetensors")


@pytest.mark.parametrize("preserve_on", ["empty_caption", "caption"])
def test_the_teacher_is_the_frozen_base_with_the_accelerator(tiny_model, squares_dataset, accelerator_file, tmp_path,
                                                             preserve_on):
    """After training (the LoRA no longer zero) a step's teacher equals a fresh base model's prediction with the
    accelerator attached, on the same noisy latents with the empty caption (`empty_caption`, the default) or the
    step's own caption (`caption`: the trained side of the term is then the step's prediction itself); the trained
    side differs from it."""
    base = tiny_model("wan2.1-t2v")
    trainer = train(tmp_path, base, squares_dataset, steps=2,
                    overrides=_preserve(accelerator_file) + [f"distill.preserve_on={preserve_on}"])
    batch = next(iter(trainer.data.batches(0)))
    with trainer.setup.training_step():
        prediction = trainer.setup.predict(batch, torch.Generator().manual_seed(5))
    fresh = load(base)
    text = batch["text_embeds"]
    if preserve_on == "empty_caption":
        text = fresh.encode_text([""]).expand(text.shape[0], -1, -1)
    with torch.no_grad(), accelerated(fresh, load_accelerator(fresh, AcceleratorConfig(file=str(accelerator_file)))):
        expected = fresh.transformer(hidden_states=prediction.noisy, timestep=prediction.sigmas * 1000,
                                     encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(prediction.teacher, expected, atol=1e-5, rtol=1e-5)
    assert (prediction.preserved - expected).abs().max() > 1e-3
    assert torch.equal(prediction.preserved, prediction.predicted) == (preserve_on == "caption")


def test_a_preserve_run_resumes_bit_identically(tiny_model, squares_dataset, accelerator_file, tmp_path):
    base = tiny_model("wan2.1-t2v")
    common = _preserve(accelerator_file) + ["backup.every_n_steps=3", "data.concepts.0.seed=3"]
    full = train(tmp_path / "full", base, squares_dataset, steps=5, overrides=common)
    first = train(tmp_path / "split", base, squares_dataset, steps=3, overrides=common)
    resumed = train(tmp_path / "split", base, squares_dataset, steps=5,
                    overrides=common + ["backup.continue_last_backup=true"])
    assert_resumed_identically(full, first, resumed, 5)


def test_preserve_config_errors_stop_before_any_model_loads(tiny_model, squares_dataset, accelerator_file, tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "train.py"),
               "--config-value", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
               "--config-value", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
               "--config-value", f"workspace_dir={tmp_path / 'run'}", "--config-value", "device=cpu",
               "--config-value", "distill.mode=preserve"]
    alone = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2, alone.stderr
    assert "distill.mode" in alone.stderr and "sampling.accelerator.file" in alone.stderr
    fine_tune = subprocess.run(command + ["--config-value", "training_method=FINE_TUNE", "--config-value",
                                          "output.format=DIFFUSERS", "--config-value",
                                          "distill.preserve_weight=-1"], capture_output=True, text=True, timeout=120)
    assert fine_tune.returncode == 2, fine_tune.stderr
    assert "preserve_weight" in fine_tune.stderr
    fine_tune = subprocess.run(command + ["--config-value", "training_method=FINE_TUNE", "--config-value",
                                          "output.format=DIFFUSERS", "--config-value",
                                          f"sampling.accelerator.file={accelerator_file}"],
                               capture_output=True, text=True, timeout=120)
    assert fine_tune.returncode == 2 and "training_method is FINE_TUNE" in fine_tune.stderr, fine_tune.stderr
    assert "run plan" not in alone.stdout + fine_tune.stdout and not (tmp_path / "run").exists()


def test_the_planner_holds_the_accelerator_at_its_files_rank(tiny_model, accelerator_file):
    """The planned weights grow by the accelerator's factors (rank x (in + out) per block attention / FFN layer, in
    the base weights' dtype, float32 here, as the hooks compute in), at the rank read from the file's header, or at
    the assumed rank 64 when the file is not there (a preset's placeholders); the plan's line says which and names
    the teacher pass. (The planned step against the same step run for real: test_memory_planner.py's "distill
    preserve" switches.)"""
    from modules.planner.plan_shapes import resolve_architecture
    from modules.planner.step_trace import trace_step
    from test_memory_planner import TINY_SHAPE, tiny_config
    base = tiny_model("wan2.1-t2v")
    linears = [m for n, m in load(base).transformer.named_modules() if isinstance(m, torch.nn.Linear)
               and n.startswith("blocks.") and (".attn" in n or ".ffn" in n)]
    per_rank = sum(4 * (m.in_features + m.out_features) for m in linears)

    def planned(**values):
        config = tiny_config(base, training_method="LORA", gradient_checkpointing=True, **values)
        counter, facts = trace_step(config, resolve_architecture(config), TINY_SHAPE)
        return counter.breakdown()["weights"], facts.get("distill", "")
    weights, _ = planned()
    missing = {"accelerator": {"file": str(accelerator_file.parent / "missing.safetensors")}}
    assumed, line = planned(distill={"mode": "preserve", "preserve_weight": 0}, sampling=missing)
    assert assumed - weights == 64 * per_rank and line == "distill preserve: accelerator rank 64 (assumed) attached"
    _, line = planned(distill={"mode": "preserve"}, sampling=missing)
    assert line.endswith("attached, teacher pass on the empty caption (weight 0.5)")
    read, line = planned(distill={"mode": "preserve", "preserve_weight": 0},
                         sampling={"accelerator": {"file": str(accelerator_file)}})
    assert read - weights == 4 * per_rank and "accelerator rank 4 attached" in line


def test_the_training_tab_shows_the_mode_and_its_memory_line_names_it(tiny_model, accelerator_file):
    """The GUI's controllers (no display): distill.mode is a field of the edited config (the training tab places
    every section no other tab does), a change of it re-plans the memory line, and the line names the accelerator
    and the teacher pass the prediction includes."""
    from modules.ui.config_fields import section_fields
    from modules.ui.CtkTrainingTabView import MEMORY_PATHS, PLACED_ELSEWHERE
    from modules.ui.MemoryPlanController import MemoryPlanController
    from modules.ui.UIState import UIState
    assert "distill" not in PLACED_ELSEWHERE and "distill" in MEMORY_PATHS
    assert {spec.name for spec in section_fields("distill")} >= {"mode", "preserve_weight"}
    state = UIState({"model": {"base_model_name": str(tiny_model("wan2.1-t2v"))}, "gradient_checkpointing": True,
                     "data": {"resolution": 64, "frame_buckets": [9]}, "optimizer": {"optimizer": "ADAMW"},
                     "sampling": {"accelerator": {"file": str(accelerator_file)}}})
    assert state.set_text("distill.mode", "preserve") is None
    assert state.config().distill.mode == "preserve"
    controller = MemoryPlanController(state)
    assert controller.predict(4.0)
    controller.wait(120)
    text = controller.poll()
    assert text.startswith("fits 4 GiB: ")
    assert "(distill preserve: accelerator rank 4 attached, teacher pass on the empty caption" in text
    assert state.set_text("distill.mode", "slow") is not None or "distill.mode" in " ".join(state.validate())


def test_preserve_on_the_distilled_animate_2_release_matches_the_release_itself(tiny_model, tmp_path):
    """Animate-2's distilled release (its model_index names WanAnimate2DistilledModularPipeline) is its own
    accelerator: preserve trains on it without sampling.accelerator, the teacher being the release without the LoRA.
    The first step's loss is the base mode's (LoRA at zero: no teacher term yet), later ones differ; the same config
    on the ordinary Animate-2 release stops before its weights load."""
    from modules.util.config.config_io import ConfigError
    from modules.util.demo_animate import make_animate_2_dataset
    folder = make_animate_2_dataset(tmp_path / "data", clips_per_class=1, frames=5, size=32)
    for path in folder.iterdir():
        if not path.name.startswith(("red_left", "green_right")):
            path.unlink()
    release = tiny_model("wan2.2-animate-2")
    distilled = tmp_path / "distilled"
    distilled.mkdir()
    for part in release.iterdir():
        if part.name != "model_index.json":
            (distilled / part.name).symlink_to(part)
    index = json.loads((release / "model_index.json").read_text(encoding="utf-8"))
    index["_class_name"] = "WanAnimate2DistilledModularPipeline"
    (distilled / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    common = ["data.frame_buckets=[5]", "optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=4", "batch_size=2",
              f"cache_dir={tmp_path / 'cache'}"]
    plain = train(tmp_path / "base", distilled, folder, steps=3, overrides=common)
    preserved = train(tmp_path / "preserve", distilled, folder, steps=3,
                      overrides=common + ["distill.mode=preserve", "distill.preserve_on=caption"])
    assert preserved.step_losses[0] == plain.step_losses[0] and preserved.step_losses[1:] != plain.step_losses[1:]
    batch = next(iter(preserved.data.batches(0)))
    with preserved.setup.training_step():
        prediction = preserved.setup.predict(batch, torch.Generator().manual_seed(5))
    transformer = preserved.model.transformer
    transformer.disable_adapters()
    try:
        with torch.no_grad():
            expected = preserved.setup.predict(batch, torch.Generator().manual_seed(5)).predicted
    finally:
        transformer.enable_adapters()
    torch.testing.assert_close(prediction.teacher, expected)
    assert (prediction.preserved - expected).abs().max() > 1e-4
    with pytest.raises(ConfigError, match="distill.mode"):
        train(tmp_path / "ordinary", release, folder, steps=1, overrides=common + ["distill.mode=preserve"])


def test_distill_settings_a_run_does_not_use_are_named(caplog):
    """preserve settings under mode base and a stack check without an accelerator are ignored by the run: each is
    said (prepare_config calls this before any model loads); the defaults say nothing."""
    import logging
    from modules.trainer.prepare import note_inapplicable_distill
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig()
    config.distill.preserve_weight = 2.0
    config.distill.stack_check = False
    with caplog.at_level(logging.WARNING):
        note_inapplicable_distill(config)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "distill.preserve_weight / distill.preserve_on are set, but distill.mode is base" in said
    assert "distill.stack_check is set, but sampling.accelerator has no file" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        note_inapplicable_distill(TrainConfig())
    assert not caplog.records
