"""Files that say what they are (issue 24, section 1): E2V's image encoder named on the command line (or Wan 2.1
I2V's for a hub-id base), E2V LoRA and fine-tune files that carry their element layout and image encoder, A14B
expert files that carry their expert and boundary, and the format notes at save time."""
import json
import sys
from pathlib import Path

import pytest

from modules.util.config.config_io import ConfigError, load_config
from modules.trainer.prepare import prepare_config
from modules.util.demo_e2v import make_e2v_dataset
from seed_configs import fixture_text, user_seed_path, user_seed_text, with_data_root

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402


@pytest.fixture(scope="module")
def e2v_dataset(tmp_path_factory):
    return make_e2v_dataset(tmp_path_factory.mktemp("e2v") / "data", clips_per_class=1, frames=17)


def seed_001_config(tmp_path, e2v_dataset) -> Path:
    text = user_seed_text("001") if user_seed_path("001") else fixture_text("001")
    path = tmp_path / "seed001.json"
    path.write_text(with_data_root(text, e2v_dataset), encoding="utf-8")
    return path


def seed_001_flags(model: str, dataset_config: Path, output: Path) -> list[str]:
    """Seed 001's example command line, its flags and values (the model and paths as given)."""
    return ["--model_name", model, "--training_type", "e2v-lora", "--output_dir", str(output),
            "--dataset_configs", str(dataset_config), "--e2v_type", "dual", "--frame_conditioning_type", "full",
            "--frame_conditioning_concatenate_mask", "--mixed_precision", "bf16", "--rank", "64", "--lora_alpha", "64"]


def prepared(argv: list[str]):
    args = train_script.build_parser().parse_args(argv)
    config = load_config(None, None, train_script.seed_options_as_overrides(args) + args.config_value)
    prepare_config(config)
    return config


# --- the image encoder ------------------------------------------------------------------------------------------

def test_seed_001_with_its_hub_id_takes_wan_2_1_i2v_image_encoder(tmp_path, e2v_dataset, monkeypatch, caplog,
                                                                 capsys):
    """Seed 001's command as written (a T2V 1.3B hub id, e2v_type dual): no config error; the image encoder is Wan
    2.1 I2V's, said before anything loads."""
    from modules.util.config.image_encoder_source import WAN_I2V_IMAGE_ENCODER
    monkeypatch.chdir(tmp_path)
    config = prepared(seed_001_flags("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", seed_001_config(tmp_path, e2v_dataset),
                                     tmp_path / "output"))
    assert config.model.image_encoder.path == WAN_I2V_IMAGE_ENCODER and config.model.allow_download
    assert any(WAN_I2V_IMAGE_ENCODER in r.getMessage() and "CLIP" in r.getMessage() for r in caplog.records)
    # run as written on a machine that cannot reach the hub (offline, an empty cache): exit 1 with one sentence
    # naming the hub id and what to do, not huggingface_hub's traceback
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    flags = seed_001_flags("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", seed_001_config(tmp_path, e2v_dataset),
                           tmp_path / "output")
    # --ram-gib: this checks the offline hub, not the test machine's RAM (the 1.3B base with its float32 UMT5-XXL is
    # planned at about 29 GiB of host RAM; on a smaller machine the user is told so before anything loads, exit 2)
    assert train_script.main(flags + ["--config-value", "device=cpu", "--ram-gib", "64"]) == 1
    err = capsys.readouterr().err
    assert "model.base_model_name 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers': model_index.json is neither in the Hugging " \
           "Face cache nor downloadable" in err and "Traceback" not in err


def test_a_local_base_without_an_image_encoder_is_a_config_error_naming_the_flag(tmp_path, e2v_dataset, tiny_model,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = seed_001_flags(str(tiny_model("wan2.1-t2v")), seed_001_config(tmp_path, e2v_dataset), tmp_path / "out")
    with pytest.raises(ConfigError) as caught:
        prepared(flags)
    [problem] = [p for p in caught.value.problems if p.startswith("model.image_encoder.path")]
    assert "--image_encoder PATH_OR_HUB_ID" in problem and "image_encoder/" in problem and "'dual'" in problem
    # the flag names one: a folder, or a hub id (its download implied), accepted before anything loads
    config = prepared(flags + ["--image_encoder", str(tiny_model("wan2.1-i2v"))])
    assert config.model.image_encoder.path == str(tiny_model("wan2.1-i2v"))
    config = prepared(flags + ["--image_encoder", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"])
    assert config.model.image_encoder.path == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers" and config.model.allow_download


# --- E2V files carry their layout -------------------------------------------------------------------------------

def run_sample(argv: list[str]) -> int:
    import sample
    return sample.main(argv)


@pytest.fixture(scope="module")
def e2v_lora(tiny_model, e2v_dataset, tmp_path_factory):
    """docs/e2v.md's worked example (T2V base, dual pathway), two steps, the image encoder named by the new flag;
    as there, the base is named relative to the folder the run starts in (the tests sample from elsewhere)."""
    import contextlib
    import io
    import os
    out = tmp_path_factory.mktemp("e2v_out")
    printed = io.StringIO()
    started_in = os.getcwd()
    os.chdir(out)
    try:
        with contextlib.redirect_stdout(printed):
            code = train_script.main([
                "--dataset_configs", str(e2v_dataset / "e2v_config.json"), "--training_type", "e2v-lora",
                "--e2v_type", "dual", "--model_name", os.path.relpath(tiny_model("wan2.1-t2v")),
                "--output_dir", str(out), "--rank", "16", "--lora_alpha", "16", "--mixed_precision", "no",
                "--image_encoder", str(tiny_model("wan2.1-i2v")), "--config-value", "device=cpu",
                "--config-value", "max_steps=2", "--config-value", f"cache_dir={out / 'cache'}",
                "--config-value", "tensorboard=false"])
    finally:
        os.chdir(started_in)
    assert code == 0
    return out / "e2v_lora.safetensors", printed.getvalue()


def test_an_e2v_lora_samples_with_the_file_alone(e2v_lora, tiny_model, e2v_dataset, tmp_path, capsys):
    """`sample.py --lora F --element NAME=IMAGE` (as the GUI's tools tab runs it): the LoRA's header records its
    element layout, its image encoder and its base (no --image-encoder, --e2v-config or --base-model-name)."""
    from safetensors import safe_open
    e2v_lora, _ = e2v_lora
    with safe_open(str(e2v_lora), "pt") as file:
        metadata = file.metadata()
    assert metadata["e2v_image_encoder"] == str(tiny_model("wan2.1-i2v").resolve())
    layout = json.loads(metadata["e2v_config"])
    assert layout["e2v_type"] == "dual" and [e["name"] for e in layout["elements"]][:1] == ["main_subject"]
    # the base as the run was given it (relative to its folder), and where that folder is
    assert not Path(json.loads(metadata["training_config"])["model"]["base_model_name"]).is_absolute()
    assert metadata["wan_base_model"] == str(tiny_model("wan2.1-t2v").resolve())
    # the GUI's tools tab with only the LoRA, the prompt and the element filled in: not even a base model (the
    # header's training config names it)
    from modules.ui.ToolsController import sample_command
    command = sample_command("", "x", str(tmp_path), loras=[str(e2v_lora)], width=32, height=32, frames=17, steps=2,
                             elements={"main_subject": str(e2v_dataset / "000_person.png")}, device="cpu")
    assert command[0] == "sample" and "--base-model-name" not in command and "--e2v-config" not in command
    code = run_sample(command[1:])
    assert code == 0, capsys.readouterr().err
    assert len(list(tmp_path.glob("*.mp4"))) == 1


def test_an_element_is_named_by_its_name_or_its_files_suffix_and_an_unknown_one_stops_before_loading(
        e2v_lora, e2v_dataset, tmp_path, capsys):
    """sample.py's help and issue 24 write `--element person=img.png`; seed 001's layout calls that element
    main_subject and finds its files by `_person.png`, so the suffix's word names it too. A name the layout lacks is
    exit 2 before any model loads (the base named here does not exist), naming the elements and their words."""
    e2v_lora, _ = e2v_lora
    size = ["--width", "32", "--height", "32", "--frames", "17", "--steps", "1", "--device", "cpu"]
    code = run_sample(["--lora", str(e2v_lora), "--prompt", "x",
                       "--element", f"person={e2v_dataset / '000_person.png'}",
                       "--output-dir", str(tmp_path / "person"), *size])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "--element person: the element 'main_subject'" in err
    assert len(list((tmp_path / "person").glob("*.mp4"))) == 1
    code = run_sample(["--base-model-name", str(tmp_path / "no-such-model"), "--lora", str(e2v_lora), "--prompt", "x",
                       "--element", f"hero={e2v_dataset / '000_person.png'}", "--output-dir", str(tmp_path), *size])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--element hero: the E2V layout {e2v_lora} records has no such element" in err
    assert "main_subject (or dog, person, mask)" in err and "no-such-model" not in err


def test_an_e2v_config_that_differs_from_the_recorded_layout_is_an_error_naming_the_difference(
        e2v_lora, tiny_model, e2v_dataset, tmp_path, capsys):
    e2v_lora, _ = e2v_lora
    config = json.loads((e2v_dataset / "e2v_config.json").read_text())
    dataset = config["datasets"][0] if "datasets" in config else config
    dataset["elements"][0]["name"] = "hero"
    (tmp_path / "other.json").write_text(json.dumps(config))
    code = run_sample(["--base-model-name", str(tiny_model("wan2.1-t2v")), "--lora", str(e2v_lora), "--prompt", "x",
                       "--e2v-config", str(tmp_path / "other.json"),
                       "--element", f"hero={e2v_dataset / '000_person.png'}",
                       "--device", "cpu", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "elements.0.name: --e2v-config has 'hero'" in err and "'main_subject'" in err and str(e2v_lora) in err
    assert not list(tmp_path.glob("*.mp4"))


def test_the_run_plans_its_image_encoder_and_its_next_sample_line_runs(e2v_lora, tiny_model, e2v_dataset, tmp_path,
                                                                        capsys):
    """The plan names where the image encoder comes from; the "next: sample" line the run prints runs with its
    placeholders filled (the prompt, the element) and the tiny model's size."""
    import shlex
    _, printed = e2v_lora
    assert f"image encoder: {tiny_model('wan2.1-i2v')} (model.image_encoder.path)" in printed
    [line] = [line for line in printed.splitlines() if "sample with the LoRA:" in line]
    # the elements by the names the layout gives them: the required one to fill in, the optional ones after a comment
    assert line.endswith("--element main_subject=IMAGE  # optional: --element secondary=IMAGE "
                         "--element environment=IMAGE")
    argv = shlex.split(line.split("sample with the LoRA:")[1])[2:]          # after run-cmd.sh sample
    assert "--e2v-config" not in argv and "--image-encoder" not in argv
    argv = argv[:argv.index("--element")] + ["--element", f"main_subject={e2v_dataset / '000_person.png'}"]
    argv[argv.index("--prompt") + 1] = "a square moving left"
    argv[argv.index("--output-dir") + 1] = str(tmp_path)
    code = run_sample(argv + ["--width", "32", "--height", "32", "--frames", "17", "--steps", "1", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    assert len(list(tmp_path.glob("*.mp4"))) == 1


def test_an_e2v_fine_tune_folder_carries_its_layout(tiny_model, e2v_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    code = train_script.main([
        "--dataset_configs", str(e2v_dataset / "e2v_config.json"), "--training_type", "e2v-sft", "--e2v_type", "vae",
        "--model_name", str(tiny_model("wan2.1-t2v")), "--output_dir", str(out), "--mixed_precision", "no",
        "--config-value", "device=cpu", "--config-value", "max_steps=1", "--config-value", "tensorboard=false",
        "--config-value", f"cache_dir={tmp_path / 'cache'}"])
    assert code == 0, capsys.readouterr().err
    folder = out / "e2v_model"
    layout = json.loads((folder / "e2v_config.json").read_text())["datasets"][0]
    assert layout["e2v_type"] == "vae"
    code = run_sample(["--base-model-name", str(folder), "--prompt", "x", "--element",
                       f"main_subject={e2v_dataset / '000_person.png'}", "--width", "32", "--height", "32",
                       "--frames", "17", "--steps", "1", "--device", "cpu", "--output-dir", str(tmp_path / "s")])
    assert code == 0, capsys.readouterr().err
    assert len(list((tmp_path / "s").glob("*.mp4"))) == 1


# --- A14B expert files ------------------------------------------------------------------------------------------

def tiny_run_values(base, dataset, out: Path) -> list[str]:
    values = [f"model.base_model_name={base}", f"workspace_dir={out / 'ws'}", f"cache_dir={out / 'cache'}",
              f"output.destination={out / 'lora.safetensors'}", "device=cpu", "train_dtype=FLOAT_32",
              "gradient_checkpointing=false", "max_steps=1", f'data.concepts=[{{"path": "{dataset}"}}]',
              "data.frame_buckets=[9]", "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0",
              "tensorboard=false"]
    return [argument for value in values for argument in ("--config-value", value)]


@pytest.fixture(scope="module")
def a14b_loras(tiny_model, squares_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("a14b")
    values = tiny_run_values(tiny_model("wan2.2-t2v-a14b"), squares_dataset, out)
    assert train_script.main(values + ["--config-value", "model_type=WAN_2_2"]) == 0
    return out / "lora_high_noise.safetensors", out / "lora_low_noise.safetensors"


def test_a14b_expert_files_record_their_expert_and_boundary(a14b_loras, tiny_model):
    from modules.util.expert_metadata import recorded_expert
    index = json.loads((tiny_model("wan2.2-t2v-a14b") / "model_index.json").read_text())
    high, low = a14b_loras
    assert recorded_expert(high) == ("high", index["boundary_ratio"])
    assert recorded_expert(low) == ("low", index["boundary_ratio"])


def test_an_expert_file_renamed_to_the_other_expert_is_refused(a14b_loras, tiny_model, tmp_path, capsys):
    import shutil
    high, _ = a14b_loras
    shutil.copy(high, tmp_path / "swapped_low_noise.safetensors")     # the high-noise file, renamed
    code = run_sample(["--base-model-name", str(tiny_model("wan2.2-t2v-a14b")), "--lora",
                       str(tmp_path / "swapped_low_noise.safetensors"), "--prompt", "x", "--width", "32",
                       "--height", "32", "--frames", "5", "--steps", "1", "--device", "cpu",
                       "--output-dir", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 1 and "wan_expert='high'" in err and "low-noise expert" in err
    # and as training's starting point for the low-noise expert: a config problem, found before any model loads
    from modules.util.config.validation import expert_file_problems
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.2-t2v-a14b')}", "expert=low",
                                    "model_type=WAN_2_2",
                                    f"lora.init_from={tmp_path / 'swapped_low_noise.safetensors'}"])
    [problem] = expert_file_problems(config)
    assert problem.startswith("lora.init_from: ") and "wan_expert='high'" in problem


def test_a_file_for_both_experts_loaded_into_one_is_noted(a14b_loras, tiny_model, tmp_path, caplog):
    import logging
    from safetensors.torch import load_file, save_file
    from modules.model.WanModel import WanModel  # noqa: F401 - the loader's model
    from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
    from modules.util.enum.DataType import DataType
    import torch
    high, _ = a14b_loras
    from safetensors import safe_open
    with safe_open(str(high), "pt") as file:
        metadata = dict(file.metadata())
    metadata["wan_expert"] = "both"
    save_file(load_file(str(high)), str(tmp_path / "both_high_noise.safetensors"), metadata)
    model = load_model_for_sampling(str(tiny_model("wan2.2-t2v-a14b")), DataType.FLOAT_32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        apply_lora_files(model, [(tmp_path / "both_high_noise.safetensors", 1.0)])
    assert any("wan_expert='both'" in r.getMessage() and "high-noise expert only" in r.getMessage()
               for r in caplog.records)


# --- format notes at save time ----------------------------------------------------------------------------------

def test_a_diffusers_lora_run_says_once_that_comfyui_ignores_it_and_the_summary_repeats_it(
        tiny_model, squares_dataset, tmp_path, capsys):
    values = tiny_run_values(tiny_model("wan2.1-t2v"), squares_dataset, tmp_path)
    assert train_script.main(values + ["--config-value", "output.format=DIFFUSERS_LORA", "--config-value",
                                       "backup.save_every_n_steps=1", "--config-value", "max_steps=2"]) == 0
    out = capsys.readouterr().out
    before, summary = out.split("run finished:")
    assert before.count("note: DIFFUSERS_LORA: ComfyUI's LoRA loader") == 1   # an intermediate save and the final
    assert "for ComfyUI use COMFY_LORA" in summary.split("next:")[0]


@pytest.mark.parametrize("lora_type, dora, fmt, expected", [
    ("LORA", True, "COMFY_LORA", ["DoRA in COMFY_LORA: ComfyUI applies .dora_scale with another formula",
                                   "30 %", "--merge-lora"]),
    ("LOHA", False, "COMFY_LORA", ["LOHA in COMFY_LORA: diffusers' load_lora_weights refuses"]),
    ("LOKR", False, "KOHYA_LORA", ["LOKR in KOHYA_LORA: diffusers' load_lora_weights refuses"]),
    ("LORA", False, "COMFY_LORA", []),
])
def test_each_format_note_and_docs_formats_states_it(lora_type, dora, fmt, expected):
    from modules.util.lora.format_notes import format_notes
    notes = format_notes("LORA", fmt, lora_type, dora)
    assert all(any(text in note for note in notes) for text in expected) and bool(notes) == bool(expected)
    docs = " ".join((ROOT / "docs" / "formats.md").read_text(encoding="utf-8").split())
    for statement in ("ComfyUI's LoRA loader recognises none of its keys", "up to about 30 % of the delta",
                      "the trainer prints it once when it saves and repeats it in the run summary"):
        assert statement in docs


def test_an_image_encoder_named_by_hub_id_loads_from_the_hub_cache(tiny_model, tmp_path, monkeypatch):
    """The hub path of --image_encoder, offline: a hub cache holding a diffusers repository (the tiny I2V model's
    image_encoder/ and image_processor/, in huggingface_hub's cache layout) is what a download leaves."""
    import shutil
    import huggingface_hub.constants
    import torch
    from modules.modelLoader.wan.hub_image_encoder import load_hub_image_encoder
    snapshot = tmp_path / "models--Wan-AI--Wan2.1-I2V-14B-480P-Diffusers" / "snapshots" / ("0" * 40)
    for part in ("image_encoder", "image_processor"):
        shutil.copytree(tiny_model("wan2.1-i2v") / part, snapshot / part)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    encoder, processor = load_hub_image_encoder("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", torch.float32)
    from transformers import CLIPVisionModel
    reference = CLIPVisionModel.from_pretrained(tiny_model("wan2.1-i2v"), subfolder="image_encoder")
    pixels = torch.randn(1, 3, processor.crop_size["height"], processor.crop_size["width"])
    with torch.no_grad():
        assert torch.equal(encoder(pixels).last_hidden_state, reference(pixels).last_hidden_state)
