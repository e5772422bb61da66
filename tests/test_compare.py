"""Issue 22 item 4: the checkpoint x strength comparison (docs/compare.md). Every cell equals a sample made the way
scripts/sample.py makes one (a fresh model, the LoRA file merged at that strength, the same sample and seed), the
base model is loaded once for all cells, and the grid, contact sheet and layout file have the labelled layout."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.LoraComparison import LoraComparison
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.modelSampler.compare_grid import HEADER_HEIGHT, LABEL_WIDTH
from modules.modelSampler.lora_checkpoints import find_checkpoints, step_from_name
from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import LoraModule, save_lora_file
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = [{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 5, "steps": 2, "seed": 3,
            "guidance": 1.0},
           {"prompt": "a blue square", "width": 32, "height": 32, "frames": 5, "steps": 2, "seed": 9,
            "guidance": 1.0}]


def random_lora(transformer, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks.") and ".attn1" in name:
            weights[name] = LoraModule(down=torch.randn(4, module.in_features, generator=generator) * 0.3,
                                       up=torch.randn(module.out_features, 4, generator=generator) * 0.3, alpha=2.0)
    return weights


def compare_script():
    return load_script("compare")


def test_step_names_and_folders(tmp_path):
    assert [step_from_name(n) for n in ("step-00000100.safetensors", "lora-500", "my_lora", "x_step250_high_noise")] \
        == [100, 500, None, 250]
    for name in ("step-00000200.safetensors", "step-00000050.safetensors", "final.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert [(c.label, c.step) for c in find_checkpoints([tmp_path])] == \
        [("step-00000050", 50), ("step-00000200", 200), ("final", None)]
    with pytest.raises(FileNotFoundError, match="no such LoRA"):
        find_checkpoints([tmp_path / "missing.safetensors"])


def test_grid_cells_equal_single_samples_and_the_base_loads_once(tiny_model, tmp_path, monkeypatch):
    folder = tiny_model("wan2.1-t2v")
    reference_model = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    first, second = tmp_path / "lora-step-100.safetensors", tmp_path / "lora-step-200.safetensors"
    save_lora_file(random_lora(reference_model.transformer, 1), ModelFormat.COMFY_LORA, first)
    save_lora_file(random_lora(reference_model.transformer, 2), ModelFormat.KOHYA_LORA, second)
    samples_file = tmp_path / "samples.json"
    samples_file.write_text(json.dumps(SAMPLES))

    loads, cells = [], {}
    original_load, original_cell = WanBaseModelLoader.load, LoraComparison.sample_cell

    def counting_load(self, *args, **kwargs):
        loads.append(1)
        return original_load(self, *args, **kwargs)

    def recording_cell(self, cell, sample, on_step=None):
        result = original_cell(self, cell, sample, on_step)
        name = None if cell.checkpoint is None else cell.checkpoint.label
        cells[(name, cell.strength, sample.seed)] = result.frames
        return result

    monkeypatch.setattr(WanBaseModelLoader, "load", counting_load)
    monkeypatch.setattr(LoraComparison, "sample_cell", recording_cell)
    out = tmp_path / "ws" / "compare"   # the tools tab's default output folder: the gallery lists its grids
    code = compare_script().main(["--base-model-name", str(folder), "--lora", str(first), str(second),
                                  "--strengths", "0.5", "1.0", "--samples-file", str(samples_file),
                                  "--output-dir", str(out), "--device", "cpu"])
    assert code == 0
    assert len(loads) == 1                        # the base model, once for 2 samples x (1 + 2 x 2) cells
    assert len(cells) == 2 * 5

    # each cell against sample.py's way: a fresh model, the file merged at the strength, the same sample
    for name, path, strength in (("lora-step-100", first, 0.5), ("lora-step-200", second, 1.0), (None, None, 0)):
        model = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
        if path is not None:
            apply_lora_files(model, [(path, strength)])
        sample = SampleConfig(**SAMPLES[1])
        expected = WanModelSampler(model, device=torch.device("cpu")).sample(sample).frames
        assert np.abs(cells[(name, strength, 9)] - expected).max() <= 1e-6
    # the LoRA changes the output, and the strength matters
    assert np.abs(cells[("lora-step-100", 0.5, 3)] - cells[(None, 0.0, 3)]).max() > 1e-3
    assert np.abs(cells[("lora-step-100", 0.5, 3)] - cells[("lora-step-100", 1.0, 3)]).max() > 1e-3

    # the layout: rows base + 2 checkpoints, columns the strengths, labels drawn, cells the samples' pixels
    layout = json.loads((out / "000-a-red-square-moving-left-s3.json").read_text())
    assert layout["rows"] == [["base model", "no LoRA"], ["lora-step-100", "step 100"], ["lora-step-200", "step 200"]]
    assert layout["columns"] == ["strength 0.5", "strength 1"]
    scale = layout["scale"]
    assert scale == 4 and layout["cells"][1][1] == [HEADER_HEIGHT + 128, LABEL_WIDTH + 128, 128, 128]
    sheet = np.asarray(Image.open(out / "000-a-red-square-moving-left-s3.png"))
    assert sheet.shape == (HEADER_HEIGHT + 3 * 128, LABEL_WIDTH + 2 * 128, 3)
    middle = layout["middle_frame"]
    for row, (name, strength) in enumerate([(None, 0.0), ("lora-step-100", 0.5), ("lora-step-200", 0.5)]):
        top, left, height, width = layout["cells"][row][0]
        frame = (cells[(name, strength, 3)][middle] * 255).round().clip(0, 255).astype(np.uint8)
        assert np.array_equal(sheet[top:top + height:scale, left:left + width:scale], frame)
    base_cells = [layout["cells"][0][column] for column in range(2)]   # the base (no strength) in every column
    assert [sheet[t:t + h, l:l + w].tolist() for t, l, h, w in base_cells[1:]] == \
        [sheet[t:t + h, l:l + w].tolist() for t, l, h, w in base_cells[:1]]
    assert sheet[:HEADER_HEIGHT, LABEL_WIDTH:].max() > 200 and sheet[HEADER_HEIGHT:, :LABEL_WIDTH].max() > 200
    import av
    with av.open(str(out / "000-a-red-square-moving-left-s3.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == sheet.shape
    assert (out / "001-a-blue-square-s9.mp4").is_file()
    from modules.ui.SampleGallery import comparison_grids
    assert sorted(p.name for p in comparison_grids(tmp_path / "ws")) == [
        "000-a-red-square-moving-left-s3.mp4", "001-a-blue-square-s9.mp4"]


def test_training_previews_at_other_strengths(tiny_model, tmp_path):
    """sampling.compare_strengths: a preview per strength beside the plain one; strength s of the adapter being
    trained is the saved LoRA merged at s, and the adapters' scaling is put back exactly."""
    from types import SimpleNamespace

    from peft import LoraConfig

    from modules.modelSampler.TrainingSampler import TrainingSampler
    from modules.util.config.TrainConfig import TrainConfig
    from modules.util.lora.apply import lora_weights_from_peft, merge_lora
    from modules.util.lora.strength import adapter_strength

    folder = tiny_model("wan2.1-t2v")
    model = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "net.2"],
                                             init_lora_weights=False), adapter_name="default")
    scalings = {n: dict(m.scaling) for n, m in model.transformer.named_modules() if hasattr(m, "scaling")}
    samples_file = tmp_path / "samples.json"
    samples_file.write_text(json.dumps(SAMPLES[:1]))
    config = TrainConfig(workspace_dir=str(tmp_path / "workspace"), train_dtype=DataType.FLOAT_32)
    config.sampling.samples_file = str(samples_file)
    config.sampling.compare_strengths = [0.5, 1.0]
    trainer = SimpleNamespace(config=config, model=model, device=torch.device("cpu"),
                              progress=SimpleNamespace(global_step=12, epoch=3), hooks=SimpleNamespace(writer=None))
    outputs = TrainingSampler(trainer).sample_all()
    folder_out = outputs[0].video.parent
    assert sorted(p.name for p in folder_out.glob("*.mp4")) == ["12-3-x0.5.mp4", "12-3.mp4"]
    assert {n: dict(m.scaling) for n, m in model.transformer.named_modules() if hasattr(m, "scaling")} == scalings

    sample = SampleConfig(**SAMPLES[0])
    with adapter_strength([model.transformer], 0.5):
        half = WanModelSampler(model).sample(sample).frames
    merged = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    merge_lora(merged.transformer, lora_weights_from_peft(model.transformer), 0.5)
    expected = WanModelSampler(merged).sample(sample).frames
    full = WanModelSampler(model).sample(sample).frames
    assert np.abs(half - expected).max() < 1e-4 < np.abs(full - expected).max()


def test_compare_strengths_is_checked(tmp_path):
    from modules.util.config.config_io import ConfigError, load_config
    with pytest.raises(ConfigError, match="sampling.compare_strengths"):
        load_config(overrides=["sampling.compare_strengths=[0.5, 20]"])
    from modules.util.config.validation import path_problems
    fine_tune = load_config(overrides=["training_method=FINE_TUNE", "output.format=DIFFUSERS",
                                       "sampling.compare_strengths=[0.5]"])
    assert any(p.startswith("sampling.compare_strengths: a strength scales a LoRA") for p in path_problems(fine_tune))


def test_gui_compare_command_parses_with_the_scripts_parser():
    from modules.ui import ToolsController as tools
    command = tools.compare_command("base", ["a.safetensors", "saves"], tools.parse_strengths("0.5, 0.75 1"), "out",
                                    samples_file="s.json")
    args = compare_script().parse_args(command[1:])
    assert command[0] == "compare" and args.lora == ["a.safetensors", "saves"]
    assert args.strengths == [0.5, 0.75, 1.0] and args.samples_file == "s.json" and args.output_dir == "out"
    with pytest.raises(ValueError, match="strengths"):
        tools.parse_strengths("0.5 strong")


def test_a_training_backup_compares_as_its_adapter(tiny_model, tmp_path):
    """A backup folder (trainable.safetensors with the adapter's peft names, config.json, progress.json, as
    GenericTrainer writes them) is a checkpoint labelled with its step; its cell at strength 1 is what the adapter
    itself samples (peft scales by lora_alpha / r, taken from the backup's config)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    folder = tiny_model("wan2.1-t2v")
    trained = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    trained.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"],
                                               init_lora_weights=False), adapter_name="default")
    backup = tmp_path / "backup" / "my-run" / "step-40"
    backup.mkdir(parents=True)
    save_file({f"transformer.{n}": p.detach().clone() for n, p in trained.transformer.named_parameters()
               if "lora_" in n}, str(backup / "trainable.safetensors"))
    (backup / "config.json").write_text(json.dumps({"training_method": "LORA", "model": {"base_model_name": str(folder)},
                                                    "lora": {"type": "LORA", "rank": 4, "alpha": 8.0}}))
    (backup / "progress.json").write_text(json.dumps({"global_step": 40, "epoch": 2}))
    checkpoints = find_checkpoints([tmp_path / "backup" / "my-run"])
    assert [(c.label, c.step) for c in checkpoints] == [("my-run/step-40", 40)]
    from modules.modelSampler.lora_checkpoints import trained_base
    assert trained_base(checkpoints[0]) == str(folder)

    base = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    comparison = LoraComparison(base, checkpoints, [1.0], torch.device("cpu"))
    sample = SampleConfig(**SAMPLES[0])
    cell = comparison.sample_cell(comparison.cells()[1], sample).frames
    expected = WanModelSampler(trained).sample(sample).frames
    assert np.abs(cell - expected).max() < 1e-4
    assert np.abs(comparison.sample_cell(comparison.cells()[0], sample).frames - expected).max() > 1e-3
    (backup / "config.json").write_text(json.dumps({"training_method": "FINE_TUNE"}))
    with pytest.raises(ValueError, match="a FINE_TUNE backup; only LoRA"):
        find_checkpoints([backup])


def test_an_a14b_pair_in_a_folder_is_one_checkpoint(tiny_model, tmp_path):
    from modules.util.lora.formats import expert_lora_paths
    folder = tiny_model("wan2.2-t2v-a14b")
    model = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    saves = tmp_path / "save"
    saves.mkdir()
    high, low = expert_lora_paths(saves / "step-00000300.safetensors")
    save_lora_file(random_lora(model.transformer, 1), ModelFormat.COMFY_LORA, high)
    save_lora_file(random_lora(model.transformer_2, 2), ModelFormat.COMFY_LORA, low)
    checkpoints = find_checkpoints([saves])
    assert [(c.label, c.step, c.files) for c in checkpoints] == [("step-00000300", 300,
                                                                   [saves / "step-00000300.safetensors"])]
    comparison = LoraComparison(model, checkpoints, [0.7], torch.device("cpu"))
    sample = SampleConfig(**SAMPLES[0])
    cell = comparison.sample_cell(comparison.cells()[1], sample).frames
    reference = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    assert len(apply_lora_files(reference, [(saves / "step-00000300.safetensors", 0.7)])) == 2  # both experts
    expected = WanModelSampler(reference, device=torch.device("cpu")).sample(sample).frames
    assert np.abs(cell - expected).max() <= 1e-6
    # the base weights are back after the cell: the base cell equals a plain model's sample
    plain = load_model_for_sampling(str(folder), DataType.FLOAT_32, torch.device("cpu"))
    assert np.array_equal(comparison.sample_cell(comparison.cells()[0], sample).frames,
                          WanModelSampler(plain, device=torch.device("cpu")).sample(sample).frames)


def test_the_sampling_tab_lists_previews_at_other_strengths_apart(tmp_path):
    from modules.ui.SamplingController import SamplingController
    from modules.ui.UIState import UIState
    folder = tmp_path / "samples" / "run" / "0-a-red-square"
    folder.mkdir(parents=True)
    for name in ("10-0.mp4", "20-1.mp4", "10-0-x0.5.mp4", "20-1-x0.5.mp4", "20-1-x-1.mp4", "10-0.png"):
        (folder / name).write_bytes(b"")
    series = SamplingController(UIState({"workspace_dir": str(tmp_path)})).previews()
    assert [(s.name, [v.step for v in s.videos]) for s in series] == [
        ("0-a-red-square", [10, 20]), ("0-a-red-square (LoRA x-1)", [20]), ("0-a-red-square (LoRA x0.5)", [10, 20])]


def test_the_base_model_comes_from_the_first_checkpoint_when_not_given(tmp_path, capsys, monkeypatch):
    from modules.modelSampler.lora_checkpoints import trained_base
    weights = {"blocks.0.attn1.to_q": LoraModule(down=torch.ones(2, 8), up=torch.ones(8, 2), alpha=2.0)}
    recorded = tmp_path / "recorded.safetensors"
    save_lora_file(weights, ModelFormat.COMFY_LORA, recorded,
                   metadata={"training_config": json.dumps({"model": {"base_model_name": "models/wan-base"}})})
    bare = tmp_path / "bare.safetensors"
    save_lora_file(weights, ModelFormat.COMFY_LORA, bare)
    assert [trained_base(c) for c in find_checkpoints([recorded, bare])] == ["models/wan-base", None]
    # a backup names its base as the run was given it, relative to the folder the run started in (docs' commands
    # do): compared from elsewhere, it is found from where the backup lies (<that folder>/<workspace_dir>/backup/...)
    started_in = tmp_path / "project"
    (started_in / "models" / "wan-base").mkdir(parents=True)
    backup = started_in / "work" / "run" / "backup" / "2026-01-01_00-00-00" / "step-00000005"
    backup.mkdir(parents=True)
    (backup / "trainable.safetensors").write_bytes(b"")
    (backup / "progress.json").write_text(json.dumps({"global_step": 5}))
    (backup / "config.json").write_text(json.dumps({"training_method": "LORA", "workspace_dir": "work/run",
                                                    "model": {"base_model_name": "models/wan-base"}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert [trained_base(c) for c in find_checkpoints([backup])] == [str(started_in / "models" / "wan-base")]
    # no --base-model-name and nothing recorded: exit 2 before any model loads
    assert compare_script().main(["--lora", str(bare), "--prompt", "x", "--output-dir", str(tmp_path)]) == 2
    assert "--base-model-name is required" in capsys.readouterr().err
    # recorded, but no folder here (relative to where it trained) and no hub id: exit 2 naming both, not a load error
    moved = tmp_path / "moved.safetensors"
    save_lora_file(weights, ModelFormat.COMFY_LORA, moved,
                   metadata={"training_config": json.dumps({"model": {"base_model_name": "work/models/base"}})})
    assert compare_script().main(["--lora", str(moved), "--prompt", "x", "--output-dir", str(tmp_path)]) == 2
    assert f"the base model 'work/models/base' that {moved} records is not a folder here" in capsys.readouterr().err
    # an E2V LoRA (its header records a layout) is no merge at a strength: said before the model loads
    e2v = tmp_path / "e2v_lora.safetensors"
    save_lora_file(weights, ModelFormat.COMFY_LORA, e2v, metadata={"e2v_config": "{}", "training_config": json.dumps(
        {"model": {"base_model_name": str(tmp_path)}})})
    assert compare_script().main(["--lora", str(e2v), "--prompt", "x", "--output-dir", str(tmp_path)]) == 2
    assert "an Elements-to-Video LoRA (it expands the model)" in capsys.readouterr().err
