"""Issue 15 sections 2 and 3: the run does what its settings say (max_steps vs epochs, what "480p" means, timestep
distributions named for what they draw, a LoRA or preset for another model caught, output files named by what they
are) and tells the user what it did (the plan at the start, files and next commands at the end, one TensorBoard /
samples folder per run that a resume continues)."""
import io
import json
import logging
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from learning import train
from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
from modules.modelSetup.timestep_sampling import sample_sigmas
from modules.util.config.config_io import ConfigError, config_from_dict, load_config
from modules.util.config.OptimizerConfig import TimestepConfig

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "training_presets"
sys.path.insert(0, str(ROOT / "scripts"))

import train as train_script  # noqa: E402


def bucket_for(config, width: int, height: int, unit: int = 16) -> tuple[int, int]:
    """(width, height) of the bucket a width x height clip trains at."""
    buckets = ResolutionBucket.make_buckets(config.data.resolution, config.data.aspect_ratios, unit)
    bucket_h, bucket_w = ResolutionBucket.choose(width, height, buckets, unit)
    return bucket_w, bucket_h


# ---- 2. the run does what its settings say -----------------------------------------------------------------------

def test_max_steps_wins_over_epochs_and_the_plan_and_report_are_printed(tiny_model, squares_dataset, tmp_path,
                                                                        capsys):
    # 24 clips / batch 4 = 6 batches an epoch: epochs=1 alone would stop at step 6 of max_steps 8
    trainer = train(tmp_path, tiny_model("wan2.1-t2v"), squares_dataset, steps=8,
                    overrides=["epochs=1", "optimizer.scheduler=LINEAR", "optimizer.learning_rate=0.001",
                               "tensorboard=true", "backup.every_n_steps=4"])
    assert trainer.progress.global_step == 8
    assert trainer.scheduler.get_last_lr()[0] == 0.0  # the LINEAR schedule ran over the 8 steps that ran
    out = capsys.readouterr().out
    trainable = sum(p.numel() for p in trainer.setup.trainable_parameters())
    for expected in ["model: T2V (WAN_2_1)", "device: cpu", "dtypes: train FLOAT_32", f"{trainable:,} trainable",
                     "targets attn-mlp, 20 modules", "steps: 8 optimizer steps", "over 2 epoch(s) of 6 batches",
                     "max_steps 8 wins over epochs 1", "schedule LINEAR over 8 steps",
                     "buckets: resolution 32 -> 32x32", "backups: ", "after steps 4, 8",
                     f"TensorBoard: {trainer.tensorboard_dir}", f"output: {tmp_path / 'out.safetensors'}",
                     # the end
                     f"wrote {tmp_path / 'out.safetensors'}", f"sample --base-model-name {tiny_model('wan2.1-t2v')}",
                     f"--lora {tmp_path / 'out.safetensors'}", "--config-value backup.continue_last_backup=true",
                     f"--logdir {tmp_path / 'run' / 'tensorboard'}"]:
        assert expected in out, expected
    assert out.index("run plan:") < out.index("run finished:")


def test_epochs_alone_plan_the_steps_that_run():
    from modules.trainer.run_report import plan_run, scheduled_steps
    config = load_config(overrides=["epochs=3", "optimizer.gradient_accumulation_steps=4"])
    plan = plan_run(config, batches_per_epoch=6)
    # accumulation counts across epoch ends: 18 batches make 4 optimizer steps (not 3 x ceil(6 / 4) = 6)
    assert (plan.total_steps, plan.epochs, plan.max_steps_wins) == (4, 3, False)
    assert scheduled_steps(plan, every_steps=0, every_epochs=1) == [1, 3, 4]


def test_480p_and_720p_train_16_9_clips_at_the_peers_sizes():
    def config(resolution, aspect_ratios=None):
        values = [f"data.resolution={resolution}"] + ([f"data.aspect_ratios={aspect_ratios}"] if aspect_ratios else [])
        return load_config(overrides=values)

    assert bucket_for(config("480p"), 1920, 1080) == (832, 480)
    assert bucket_for(config("480p"), 1080, 1920) == (480, 832)
    assert bucket_for(config("720p"), 1920, 1080) == (1280, 720)
    assert bucket_for(config("720p"), 1920, 1080, unit=32) == (1280, 704)  # TI2V-5B: Wan 2.2's 1280x704
    assert bucket_for(config("832x480"), 1920, 1080) == (832, 480)
    assert bucket_for(config("832x480", "[1.0]"), 1920, 1080) == (832, 480)  # the named size is always a bucket
    assert bucket_for(config("480p"), 640, 480) == (736, 544)   # other ratios keep the area of 832 x 480
    assert bucket_for(config(480), 1920, 1080) == (640, 368)     # an integer keeps its meaning: the area of 480^2
    with pytest.raises(ConfigError, match="data.resolution.*480i"):
        config("480i")


def test_presets_train_16_9_at_832x480_and_old_configs_keep_their_meaning(tmp_path):
    for preset in sorted(PRESETS.glob("#wan*.json")):
        config = load_config(preset_path=str(preset))
        unit = 32 if config.model.intended_variant.value == "TI2V_5B" else 16
        expected = (1280, 704) if unit == 32 else (1280, 720) if "720P" in config.model.base_model_name else (832, 480)
        assert bucket_for(config, 1920, 1080, unit) == expected, preset.name
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"__version": 1, "epochs": 2}))  # version 1 defaults: area 480^2, uniform-then-shift
    migrated = load_config(str(old))
    assert migrated.data.resolution == 480 and bucket_for(migrated, 1920, 1080) == (640, 368)
    assert migrated.timestep.distribution == "uniform_shift"
    # a hand-written file names no version: layered over a preset, it must not bring back version 1's defaults
    layer = tmp_path / "mine.json"
    layer.write_text(json.dumps({"max_steps": 5, "timestep": {"shift": 3.0}}))
    preset = PRESETS / "#wan 2.1 1.3B LoRA 24GB.json"
    layered, alone = load_config(str(layer), str(preset)), load_config(preset_path=str(preset))
    assert layered.max_steps == 5
    assert layered.data.resolution == alone.data.resolution == "480p"
    assert layered.timestep.distribution == alone.timestep.distribution == "sigmoid_shift"
    layer.write_text(json.dumps({"timestep": {"distribution": "shift"}}))  # the old name, written by hand
    assert load_config(str(layer)).timestep.distribution == "uniform_shift"


def test_timestep_distributions_match_their_names():
    def share_above(distribution: str, threshold: float = 0.9) -> float:
        config = TimestepConfig(distribution=distribution, shift=3.0)
        sigmas = sample_sigmas(config, 200_000, torch.Generator().manual_seed(0))
        return float((sigmas > threshold).float().mean())

    # musubi-tuner's "shift": sigmoid(N(0, 1)) then shifted -> P(sigma > 0.9) = P(z > logit(0.75)) = 13.6 %
    assert share_above("sigmoid_shift") == pytest.approx(0.136, abs=0.005)
    # uniform then shifted -> P(u > 0.75) = 25 %
    assert share_above("uniform_shift") == pytest.approx(0.25, abs=0.005)
    with pytest.raises(ConfigError, match="'shift' is ambiguous.*sigmoid_shift.*uniform_shift"):
        load_config(overrides=["timestep.distribution=shift"])
    version_1 = config_from_dict({"__version": 1, "timestep": {"distribution": "shift", "shift": 5.0}})
    assert version_1.timestep.distribution == "uniform_shift"  # what "shift" meant before version 2
    for preset in sorted(PRESETS.glob("#wan*.json")):
        assert load_config(preset_path=str(preset)).timestep.distribution == "sigmoid_shift", preset.name


def test_density_plot_script_writes_the_docs_png(tmp_path):
    from PIL import Image

    from plot_timestep_density import main as plot_main
    target = tmp_path / "density.png"
    assert plot_main(["--output", str(target), "--count", "20000"]) == 0
    with Image.open(target) as image:
        assert image.size[0] >= 600 and len(image.getcolors(1 << 16) or []) > 4  # drawn, not blank
    assert (ROOT / "docs" / "images" / "timestep_density.png").is_file()


def lora_file_for(folder: Path, path: Path, variant, widen: int = 0) -> Path:
    """A LoRA for the tiny model in `folder`, saved with the modelspec header of `variant`."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    from modules.util.enum.ModelFormat import ModelFormat
    from modules.util.lora.formats import LoraModule, save_lora_file
    from modules.util.modelspec import modelspec_metadata
    transformer = WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder))).transformer
    layer = transformer.get_submodule("blocks.0.attn1.to_q")
    generator = torch.Generator().manual_seed(0)
    module = LoraModule(down=torch.randn(2, layer.in_features + widen, generator=generator),
                        up=torch.randn(layer.out_features + widen, 2, generator=generator), alpha=2.0)
    save_lora_file({"blocks.0.attn1.to_q": module}, ModelFormat.COMFY_LORA, path,
                   modelspec_metadata(variant, lora=True))
    return path


def test_a_lora_for_another_variant_warns_and_a_misfit_names_both(tiny_model, tmp_path, caplog):
    from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
    from modules.modelSampler.WanModelSampler import SampleError
    from modules.util.enum.DataType import DataType
    from modules.util.enum.WanVariant import WanVariant
    t2v, i2v = tiny_model("wan2.1-t2v"), tiny_model("wan2.1-i2v")
    t2v_lora = lora_file_for(t2v, tmp_path / "t2v.safetensors", WanVariant.T2V)
    model = load_model_for_sampling(str(i2v), DataType.FLOAT_32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        apply_lora_files(model, [(t2v_lora, 1.0)])
    assert "made for wan_2_1_t2v (Wan 2.1 T2V), but the model is I2V, wan_2_1_i2v (Wan 2.1 I2V)" in caplog.text
    caplog.clear()
    model = load_model_for_sampling(str(t2v), DataType.FLOAT_32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        apply_lora_files(model, [(t2v_lora, 1.0)])
    assert "made for" not in caplog.text  # the right model: no warning
    wide = lora_file_for(t2v, tmp_path / "wide.safetensors", WanVariant.TI2V_5B, widen=8)
    with pytest.raises(SampleError, match=r"does not fit the model.*made for wan_2_2_ti2v_5b.*the model is T2V, "
                                          r"wan_2_1_t2v"):
        apply_lora_files(model, [(wide, 1.0)])


def test_training_refuses_a_preset_or_init_lora_for_another_variant(tiny_model, squares_dataset, tmp_path, capsys):
    from modules.trainer.prepare import prepare_config
    from modules.util.enum.WanVariant import WanVariant
    t2v = tiny_model("wan2.1-t2v")
    common = [f"model.base_model_name={t2v}", "model.allow_download=false", f'data.concepts=[{{"path": '
              f'"{squares_dataset}"}}]', f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    argv = ["--preset-path", "wan 2.1 I2V 14B LoRA"] + [a for v in common for a in ("--config-value", v)]
    assert train_script.main(argv) == 2
    err = capsys.readouterr().err
    assert "made for I2V models, wan_2_1_i2v (Wan 2.1 I2V)" in err and "is a T2V model, wan_2_1_t2v" in err
    assert "wan 2.1 1.3B LoRA 24GB" in err  # the presets that fit are named
    i2v_lora = lora_file_for(tiny_model("wan2.1-i2v"), tmp_path / "i2v.safetensors", WanVariant.I2V)
    with pytest.raises(ConfigError, match="lora.init_from: the LoRA .* made for wan_2_1_i2v .* the model is T2V"):
        prepare_config(load_config(overrides=common + [f"lora.init_from={i2v_lora}"]))


def test_output_dir_names_files_by_what_they_are(tmp_path):
    def destination(*options: str) -> str:
        args = train_script.build_parser().parse_args(["--output_dir", str(tmp_path), *options])
        config = load_config(overrides=train_script.seed_options_as_overrides(args) + args.config_value)
        train_script.apply_output_dir(config, args.output_dir, args.config_value)
        return config.output.destination

    e2v = tmp_path / "e2v.json"
    e2v.write_text("{}")
    assert destination() == str(tmp_path / "lora.safetensors")
    assert destination("--training_type", "lora") == str(tmp_path / "lora.safetensors")
    assert destination("--training_type", "e2v-lora", "--dataset_configs", str(e2v)) == \
        str(tmp_path / "e2v_lora.safetensors")
    assert destination("--training_type", "sft") == str(tmp_path / "model")
    assert destination("--config-value", "output.destination=/x/mine.safetensors") == "/x/mine.safetensors"


# ---- 3. the run tells the user what it did -----------------------------------------------------------------------

def test_each_run_has_its_own_log_and_samples_and_a_resume_continues_its_run(tiny_model, squares_dataset, tmp_path,
                                                                             capsys):
    base = tiny_model("wan2.1-t2v")
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "width": 32, "height": 32, "frames": 9, "steps": 1}]))
    common = ["tensorboard=true", f"sampling.samples_file={samples}", "sampling.every_n_steps=2",
              "backup.every_n_steps=2"]
    first = train(tmp_path, base, squares_dataset, steps=2, overrides=common)
    second = train(tmp_path, base, squares_dataset, steps=1, overrides=common)
    assert first.run_name != second.run_name
    assert first.tensorboard_dir.parent == second.tensorboard_dir.parent == tmp_path / "run" / "tensorboard"
    assert list(first.tensorboard_dir.glob("events.*")) and list(second.tensorboard_dir.glob("events.*"))
    assert list(first.samples_dir.rglob("2-*.mp4")) and not second.samples_dir.exists()  # no step-2 preview
    capsys.readouterr()
    # no run named: the run written last (the second, its step-1 backup), never the other run's newer step 2
    resumed = train(tmp_path, base, squares_dataset, steps=2,
                    overrides=common + ["backup.continue_last_backup=true"])
    out = capsys.readouterr().out
    assert f"resuming run {second.run_name} from step 1, written at" in out, out
    assert resumed.run_name == second.run_name and resumed.resumed_step == 1
    # the first run, named, continues from its own step 2 into its own log and previews
    resumed = train(tmp_path, base, squares_dataset, steps=4,
                    overrides=common + ["backup.continue_last_backup=true", f"run_name={first.run_name}"])
    out = capsys.readouterr().out
    assert f"resuming run {first.run_name} from step 2, written at" in out, out
    assert resumed.run_name == first.run_name
    assert len(list(first.tensorboard_dir.glob("events.*"))) == 2
    assert list(first.samples_dir.rglob("4-*.mp4"))
    assert f"preview 0-a-red-square at step 4: {first.samples_dir}" in out


def test_preset_by_name_and_list_presets(capsys):
    from modules.util.presets import resolve_preset
    path = str(PRESETS / "#wan 2.1 1.3B LoRA 24GB.json")
    for name in ["wan 2.1 1.3B LoRA 24GB", "#wan 2.1 1.3B LoRA 24GB", "wan 2.1 1.3B LoRA 24GB.json",
                 "#wan 2.1 1.3b lora 24gb.json", path]:
        assert resolve_preset(name) == path, name
    with pytest.raises(ConfigError, match="(?s)no shipped preset has that name.*demo tiny CPU"):
        resolve_preset("wan 9 LoRA")
    assert train_script.main(["--list-presets"]) == 0
    listing = capsys.readouterr().out
    assert "wan 2.1 I2V 14B LoRA" in listing and "I2V" in listing and "demo tiny CPU" in listing


@pytest.mark.parametrize("script", ["train", "cache", "sample", "convert_model", "make_tiny_model",
                                    "make_demo_dataset"])
def test_help_is_the_scripts_own_without_stray_spaces(script, monkeypatch):
    import re
    import runpy
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with redirect_stdout(out), redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "scripts" / f"{script}.py"), run_name="__main__")
    text = out.getvalue()
    module_doc = ast_docstring(ROOT / "scripts" / f"{script}.py")
    assert module_doc.splitlines()[0] in text  # its own description
    assert f"usage: {script}.py" in text
    # argparse aligns option rows ("  --opt ARG    help") and subcommands; prose and examples have single spaces
    prose = [line for line in text.splitlines() if not re.match(r"^\s+-", line) and not line.startswith("usage")]
    stray = [line for line in prose if re.search(r"\S {2,}\S", line)]
    assert not stray, stray
    if script == "cache":
        assert "Fills the latent" in text and "  --only-cache" not in text  # no option that is always on


def ast_docstring(path: Path) -> str:
    import ast
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def test_known_library_warnings_are_hidden_at_the_entry_points():
    # a fresh interpreter: transformers warns about torchvision once per process
    code = ("import sys; sys.path.insert(0, 'scripts'); import _bootstrap; import torch; "
            "from transformers import CLIPImageProcessor; "
            "torch.nn.functional.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), (8,), torch.ones(8)); "
            "import warnings; warnings.warn('an unrelated warning still shows')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONWARNINGS": "default"})
    assert result.returncode == 0, result.stderr
    assert "torchvision" not in result.stderr and "Mismatch dtype" not in result.stderr, result.stderr
    assert "an unrelated warning still shows" in result.stderr


def test_written_folders_keep_the_umask(tmp_path):
    from modules.util.atomic import atomic_dir, atomic_path
    previous = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "merged") as folder:
            (folder / "model.safetensors").write_bytes(b"x")
        with atomic_path(tmp_path / "file.json") as path:
            path.write_text("{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "merged").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "file.json").stat().st_mode & 0o777 == 0o644


def test_cpu_fallback_with_a_gpu_config_warns():
    from modules.trainer.run_report import device_warning
    gpu_preset = load_config(preset_path=str(PRESETS / "#wan 2.1 1.3B LoRA 24GB.json"))
    warning = device_warning(gpu_preset, torch.device("cpu"), transformer_parameters=1_400_000_000)
    assert "no CUDA GPU was found" in warning and "train_dtype BFLOAT_16" in warning and "ADAMW_8BIT" in warning
    assert device_warning(gpu_preset, torch.device("cuda"), 1_400_000_000) is None
    on_purpose = load_config(preset_path=str(PRESETS / "#demo tiny CPU.json"))  # device: cpu, float32
    assert device_warning(on_purpose, torch.device("cpu"), 200_000) is None
