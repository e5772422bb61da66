"""Issue 4: the training loop resumes exactly, stops cleanly on SIGINT and on NaN, trains only what the method
says, routes Wan 2.2 A14B experts by sigma, and trains every variant through the CLI."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from learning import train
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSetup.BaseWanSetup import BaseWanSetup
from modules.trainer.backup_io import all_backups, read_backup
from modules.trainer.GenericTrainer import TrainingError
from modules.util.config.ModelConfig import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def base_weights(folder) -> dict[str, torch.Tensor]:
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))
    return {f"{part}.{k}": v.clone() for part, m in model.parts().items() for k, v in m.state_dict().items()}


def test_resume_continues_identically(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    common = ["optimizer.learning_rate=0.001", "backup.every_n_steps=5", "data.concepts.0.seed=3"]
    full = train(tmp_path / "full", base, squares_dataset, steps=9, overrides=common)
    # 24 clips / batch 4 = 6 batches an epoch: step 5 is mid-epoch, so the data position matters
    first = train(tmp_path / "split", base, squares_dataset, steps=5, overrides=common)
    assert [b.name for b in all_backups(tmp_path / "split" / "run" / "backup")] == ["step-00000005"]
    resumed = train(tmp_path / "split", base, squares_dataset, steps=9,
                    overrides=common + ["backup.continue_last_backup=true"])
    assert resumed.progress.global_step == 9
    assert first.step_losses == pytest.approx(full.step_losses[:5], abs=1e-6)
    assert resumed.step_losses == pytest.approx(full.step_losses[5:], abs=1e-6)
    final_full, final_resumed = full.setup.trainable_state_dict(), resumed.setup.trainable_state_dict()
    for name in final_full:
        torch.testing.assert_close(final_resumed[name], final_full[name], atol=1e-6, rtol=0)


def test_nan_stops_and_keeps_last_good_backup(tiny_model, squares_dataset, tmp_path, monkeypatch):
    original = BaseWanSetup.calculate_loss
    calls = []

    def poisoned(self, batch, prediction):
        calls.append(1)
        loss = original(self, batch, prediction)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(BaseWanSetup, "calculate_loss", poisoned)
    with pytest.raises(TrainingError, match="step 4.*step-00000003"):
        train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, steps=10, overrides=["backup.every_n_steps=1"])
    backups = all_backups(tmp_path / "run" / "backup")
    assert backups[-1].name == "step-00000003"
    assert read_backup(backups[-1])["progress"].global_step == 3
    assert not (tmp_path / "out.safetensors").exists()


def test_sigint_writes_a_loadable_backup(tiny_model, squares_dataset, tmp_path):
    workspace = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--preset-path",
               str(ROOT / "training_presets" / "#demo tiny CPU.json"),
               "--config-value", "demo_assets=false", "--config-value", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
               "--config-value", f'data.concepts=[{{"path": "{squares_dataset}"}}]',
               # demo_assets=false: the demo's samples file is not created, and previews are not what this tests
               "--config-value", "sampling.samples_file=",
               "--config-value", f"workspace_dir={workspace}", "--config-value", f"cache_dir={tmp_path / 'cache'}",
               "--config-value", "max_steps=1000000", "--config-value", "epochs=100000",
               "--config-value", "backup.every_n_steps=0", "--config-value", "tensorboard=true"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (workspace / "tensorboard").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # well inside the loop
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output  # interrupted: exit 130 (issue 23)
    backups = all_backups(workspace / "backup")
    assert len(backups) == 1, output
    state = read_backup(backups[0])
    assert state["progress"].global_step > 0
    assert any("lora_B" in name for name in state["trainable"])


def test_lora_changes_only_adapters(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    trainer = train(tmp_path, base, squares_dataset, steps=3, overrides=["optimizer.learning_rate=0.01"])
    before = base_weights(base)
    after = {f"transformer.{k.replace('.base_layer', '')}": v for k, v in trainer.model.transformer.state_dict().items()
             if "lora_" not in k}
    for name, value in after.items():
        assert torch.equal(value, before[name]), name
    lora_b = [p for n, p in trainer.model.transformer.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: every adapter trained
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in f.keys()


def test_fine_tune_layer_filter_changes_only_filtered(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    trainer = train(tmp_path, base, squares_dataset, method="FINE_TUNE", steps=3,
                    overrides=['fine_tune.layer_filter=["blocks.1.attn1"]', "optimizer.learning_rate=0.01"])
    before = base_weights(base)
    changed = {n for n, v in trainer.model.transformer.state_dict().items()
               if not torch.equal(v, before[f"transformer.{n}"])}
    assert changed and all(n.startswith("blocks.1.attn1.") for n in changed), changed


def test_embedding_changes_only_new_rows(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    trainer = train(tmp_path, base, squares_dataset, method="EMBEDDING", steps=3,
                    overrides=["embedding.placeholder=square", "embedding.vector_count=2",
                               "optimizer.learning_rate=0.05"])
    table = trainer.model.text_encoder.get_input_embeddings().weight.detach()
    original = base_weights(base)["text_encoder.shared.weight"]
    new_ids = trainer.setup.token_ids
    old_rows = [i for i in range(original.shape[0]) if i not in new_ids]
    assert torch.equal(table[old_rows], original[old_rows])
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        saved = f.get_tensor("umt5")
    assert saved.shape == (2, table.shape[1])
    assert torch.equal(saved, table[new_ids])


@pytest.mark.parametrize("expert", ["high", "low", "both"])
def test_a14b_expert_sigma_ranges(expert, tiny_model, squares_dataset, tmp_path, monkeypatch):
    seen = []
    original = BaseWanSetup.predict

    def recording(self, batch, generator):
        prediction = original(self, batch, generator)
        seen.append((prediction.expert, prediction.sigmas.clone()))
        return prediction

    monkeypatch.setattr(BaseWanSetup, "predict", recording)
    trainer = train(tmp_path, tiny_model("wan2.2-t2v-a14b"), squares_dataset, steps=12,
                    overrides=[f"expert={expert}", "timestep.distribution=uniform_shift", "timestep.shift=3.0"])
    boundary = trainer.model.boundary_ratio
    assert boundary == 0.875
    for name, sigmas in seen:
        if name == "transformer":
            assert (sigmas >= boundary).all()
        else:
            assert (sigmas < boundary).all()
    experts = {name for name, _ in seen}
    expected = {"high": {"transformer"}, "low": {"transformer_2"}, "both": {"transformer", "transformer_2"}}[expert]
    assert experts == expected
    files = sorted(p.name for p in tmp_path.glob("out*.safetensors"))
    assert files == {"high": ["out_high_noise.safetensors"], "low": ["out_low_noise.safetensors"],
                     "both": ["out_high_noise.safetensors", "out_low_noise.safetensors"]}[expert]


# each variant with the preset made for it (presets declare their variant and training refuses another one)
PRESET_FOR = {"wan2.1-i2v": "#wan 2.1 I2V 14B LoRA.json", "wan2.1-flf2v": "#wan 2.1 FLF2V 14B LoRA.json",
              "wan2.2-ti2v-5b": "#wan 2.2 TI2V-5B LoRA.json", "wan2.2-t2v-a14b": "#wan 2.2 T2V-A14B LoRA high.json",
              "wan2.2-i2v-a14b": "#wan 2.2 I2V-A14B LoRA low.json"}


@pytest.mark.parametrize("variant", list(PRESET_FOR))
def test_every_variant_trains_through_the_cli(variant, tiny_model, squares_dataset, tmp_path):
    """The shipped presets, adapted to the tiny model with --config-value only."""
    values = [f"model.base_model_name={tiny_model(variant)}", "model.allow_download=false",
              "model.transformer.weight_dtype=FLOAT_32", "model.transformer_2.weight_dtype=FLOAT_32",
              "model.text_encoder.weight_dtype=FLOAT_32",
              "model_type=" + ("WAN_2_2" if variant.startswith("wan2.2") else "WAN_2_1"),
              f'data.concepts=[{{"path": "{squares_dataset}"}}]', "data.frame_buckets=[9]", "data.resolution=32",
              "data.aspect_ratios=[1.0]", "device=cpu", "train_dtype=FLOAT_32", "optimizer.optimizer=ADAMW",
              "max_steps=3", f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}",
              f"output.destination={tmp_path / 'lora.safetensors'}", "tensorboard=false"]
    if "A14B" in PRESET_FOR[variant]:
        # the preset swaps 16 of the 14B's 40 blocks; the tiny model has 2, so it swaps its last one
        values.append("performance.block_swap=1")
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--preset-path",
               str(ROOT / "training_presets" / PRESET_FOR[variant])]
    for value in values:
        command += ["--config-value", value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(tmp_path.glob("lora*.safetensors")), result.stdout[-2000:]


def test_previews_do_not_disturb_training(tiny_model, squares_dataset, tmp_path):
    import json
    base = tiny_model("wan2.1-t2v")
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9,
                                    "steps": 2, "seed": 1}]))
    plain = train(tmp_path / "plain", base, squares_dataset, steps=4, overrides=["optimizer.learning_rate=0.01"])
    previewed = train(tmp_path / "previews", base, squares_dataset, steps=4,
                      overrides=["optimizer.learning_rate=0.01", f"sampling.samples_file={samples}",
                                 "sampling.every_n_steps=1", "sampling.sample_before_training=true",
                                 "tensorboard=true"])
    assert previewed.step_losses == plain.step_losses
    videos = sorted((tmp_path / "previews" / "run" / "samples").rglob("*.mp4"))
    assert len(videos) == 5, videos
    assert videos[0].parent.name.startswith("0-a-red-square")
    assert list((tmp_path / "previews" / "run" / "samples").rglob("*.png"))


@pytest.mark.parametrize("optimizer", ["ADAMW_8BIT", "LION_8BIT", "ADAFACTOR", "PRODIGY"])
def test_every_optimizer_trains_and_its_state_round_trips(optimizer, tiny_model, squares_dataset, tmp_path):
    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, steps=2,
                    overrides=[f"optimizer.optimizer={optimizer}", "optimizer.learning_rate=0.01",
                               "backup.every_n_steps=2", "optimizer.ema=true", "optimizer.scheduler=COSINE",
                               "optimizer.warmup_steps=1", "optimizer.gradient_accumulation_steps=2"])
    lora_b = [p for n, p in trainer.model.transformer.named_parameters() if "lora_B" in n]
    assert all(p.abs().sum() > 0 for p in lora_b)
    state = read_backup(all_backups(tmp_path / "run" / "backup")[-1])
    trainer.optimizer.load_state_dict(state["optimizer"])  # the safetensors + JSON round trip restores it
    assert state["ema"] is not None and state["progress"].micro_step == 4


def test_dora_and_continuing_from_a_lora_file(tiny_model, squares_dataset, tmp_path):
    first = train(tmp_path / "a", tiny_model("wan2.1-t2v"), squares_dataset, steps=2,
                  overrides=["lora.dora=true", "optimizer.learning_rate=0.01"])
    with safe_open(str(tmp_path / "a" / "out.safetensors"), "pt") as f:
        assert "diffusion_model.blocks.0.self_attn.q.dora_scale" in f.keys()
    continued = train(tmp_path / "b", tiny_model("wan2.1-t2v"), squares_dataset, steps=1,
                      overrides=["lora.dora=true", "optimizer.learning_rate=1e-12",
                                 f"lora.init_from={tmp_path / 'a' / 'out.safetensors'}"])
    before = first.setup.trainable_state_dict()
    after = continued.setup.trainable_state_dict()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=1e-6, rtol=1e-5)


def test_image_tokens_with_short_text_fail_loudly(tiny_model, squares_dataset, tmp_path):
    trainer = train(tmp_path, tiny_model("wan2.1-i2v"), squares_dataset, steps=1)
    batch = next(trainer.data.batches(0))
    batch["text_embeds"] = batch["text_embeds"][:, :300]
    with pytest.raises(ValueError, match="exactly 512"):
        trainer.setup.predict(batch, torch.Generator().manual_seed(0))
