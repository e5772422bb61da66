"""LoRA files written by a real (short) training, in every format: diffusers' own `load_lora_weights` reproduces the
trained adapter's output, our loader reads back the trained weights, scripts/convert_model.py converts between the
formats without loss and merges files into a base model that samples like the adapter applied at that strength.
Wan 2.2 A14B writes one file per expert, and each goes back into its own expert."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.sampling_io import apply_lora_files
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import WAN_DEFAULT_NEGATIVE_PROMPT, SampleConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.apply import lora_weights_from_peft
from modules.util.lora.formats import LoraWeights, expert_lora_paths, load_lora_file, match_to_model
from learning import train

ROOT = Path(__file__).resolve().parent.parent
CONVERT = [sys.executable, str(ROOT / "scripts" / "convert_model.py")]
FORMATS = [ModelFormat.COMFY_LORA, ModelFormat.KOHYA_LORA, ModelFormat.DIFFUSERS_LORA]
LAYOUTS = {ModelFormat.COMFY_LORA: "comfy", ModelFormat.KOHYA_LORA: "kohya", ModelFormat.DIFFUSERS_LORA: "diffusers"}
T2V, A14B = "wan2.1-t2v", "wan2.2-t2v-a14b"
RANK, ALPHA = 4, 8.0  # alpha != rank, so DIFFUSERS_LORA's folding of alpha / rank into lora_B is exercised
TRAINING = ["optimizer.learning_rate=0.01", f"lora.rank={RANK}", f"lora.alpha={ALPHA}"]
PROMPT = "a red square moving left"
ATOL = 1e-5


def load(folder) -> object:
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def module_names(transformer) -> list[str]:
    return [name for name, _ in transformer.named_modules()]


def read_back(path: Path, transformer) -> LoraWeights:
    weights, _ = load_lora_file(path)
    return match_to_model(weights, module_names(transformer))


def assert_same_weights(got: LoraWeights, expected: LoraWeights):
    assert got.keys() == expected.keys()
    for name, module in expected.items():
        assert torch.equal(got[name].down, module.down), name
        assert torch.equal(got[name].up, module.up), name
        assert got[name].alpha == module.alpha, name


def assert_same_deltas(got: LoraWeights, expected: LoraWeights):
    assert got.keys() == expected.keys()
    for name, module in expected.items():
        torch.testing.assert_close(got[name].delta(), module.delta(), rtol=1e-6, atol=1e-7, msg=name)


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


@torch.no_grad()
def pipeline_latents(pipe, seed: int = 5) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_frames=5, num_inference_steps=2,
                guidance_scale=3.0, output_type="latent", generator=torch.Generator().manual_seed(seed)).frames


def convert(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(CONVERT + [str(a) for a in args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class Trained:
    def __init__(self, trainer, path: Path, folder: Path):
        self.trainer, self.path, self.folder = trainer, path, folder
        self.model = trainer.model
        for part in self.model.parts().values():
            part.eval()
        self.weights = lora_weights_from_peft(self.model.transformer)
        assert all(module.up.abs().sum() > 0 for module in self.weights.values())  # every lora_B trained


@pytest.fixture(scope="module")
def trained(tiny_model, squares_dataset, tmp_path_factory):
    """`get(fmt) -> Trained`: a 3-step training of the tiny T2V model that writes `fmt`, once per format."""
    done: dict[ModelFormat, Trained] = {}

    def get(fmt: ModelFormat) -> Trained:
        if fmt not in done:
            folder = tiny_model(T2V)
            tmp = tmp_path_factory.mktemp(f"train-{fmt.value}")
            trainer = train(tmp, folder, squares_dataset, steps=3, overrides=[*TRAINING, f"output.format={fmt}"])
            done[fmt] = Trained(trainer, tmp / "out.safetensors", folder)
        return done[fmt]

    return get


# ------------------------------------------------------------------------------------------------ each format

@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_diffusers_load_lora_weights_reproduces_training(fmt, trained):
    from diffusers import WanPipeline

    trained = trained(fmt)
    ours = pipeline_latents(trained.model.create_pipeline())
    peer = WanPipeline.from_pretrained(trained.folder)
    base = pipeline_latents(peer)
    peer.load_lora_weights(str(trained.path), adapter_name="trained")
    theirs = pipeline_latents(peer)
    assert (theirs - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(theirs, ours, rtol=0, atol=ATOL)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_our_loader_reads_the_trained_weights(fmt, trained):
    trained = trained(fmt)
    weights, layout = load_lora_file(trained.path)
    assert layout == LAYOUTS[fmt]
    weights = match_to_model(weights, module_names(trained.model.transformer))
    if fmt is ModelFormat.DIFFUSERS_LORA:  # alpha / rank is folded into lora_B: equal deltas
        assert all(module.alpha == module.rank for module in weights.values())
        assert all(torch.equal(weights[name].down, module.down) for name, module in trained.weights.items())
        assert_same_deltas(weights, trained.weights)
    else:
        assert all(module.alpha == ALPHA for module in weights.values())
        assert_same_weights(weights, trained.weights)
    assert metadata(trained.path)["modelspec.architecture"] == "wan_2_1_t2v/lora"


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_conversions_are_lossless(fmt, trained, tmp_path):
    """Through scripts/convert_model.py, the trained file into the next format and back (over the three formats,
    every ordered pair once): deltas unchanged at every step, the input's metadata (modelspec, training config)
    kept."""
    trained = trained(fmt)
    target = FORMATS[(FORMATS.index(fmt) + 1) % len(FORMATS)]
    original = metadata(trained.path)
    assert "training_config" in original
    there, back = tmp_path / "there.safetensors", tmp_path / "back.safetensors"
    done = convert("--training-method", "LORA", "--input-name", trained.path, "--output-model-format", target,
                   "--output-model-destination", there)
    assert done.stdout.split() == [str(there)]
    convert("--input-name", there, "--output-model-format", fmt, "--output-model-destination", back)  # LORA implied
    for path, written in ((there, target), (back, fmt)):
        weights, layout = load_lora_file(path)
        assert layout == LAYOUTS[written]
        assert_same_deltas(match_to_model(weights, module_names(trained.model.transformer)), trained.weights)
        assert metadata(path) == original
    if ModelFormat.DIFFUSERS_LORA not in (fmt, target):  # nothing folded on the way: the very same tensors
        assert_same_weights(read_back(back, trained.model.transformer), trained.weights)


# ------------------------------------------------------------------------------------------------ merging

def sample(model) -> np.ndarray:
    config = SampleConfig(prompt=PROMPT, width=32, height=32, frames=5, steps=2, guidance=4.0, seed=7)
    return WanModelSampler(model).sample(config).frames


def test_merged_model_samples_like_the_adapter_at_that_strength(trained, tmp_path):
    """scripts/convert_model.py --merge-lora FILE:0.7 into a diffusers folder, loaded and sampled, gives the frames
    of diffusers' WanPipeline with the file loaded by `load_lora_weights` at adapter weight 0.7, and those of the
    base model with the file applied at 0.7 by `apply_lora_files`."""
    from diffusers import WanPipeline

    trained = trained(ModelFormat.COMFY_LORA)  # the formats hold the same adapter (tested above)
    merged_folder = tmp_path / "merged"
    done = convert("--merge-lora", f"{trained.path}:0.7", "--base-model-name", trained.folder,
                   "--output-model-format", "DIFFUSERS", "--output-model-destination", merged_folder)
    assert done.stdout.split() == [str(merged_folder)]
    assert "strength 0.7" in done.stderr
    merged = sample(load(merged_folder))

    base = load(trained.folder)
    plain = sample(base)
    assert np.abs(merged - plain).max() > 1e-3  # the merge changed the model
    apply_lora_files(base, [(trained.path, 0.7)])
    np.testing.assert_allclose(merged, sample(base), atol=ATOL, rtol=0)

    peer = WanPipeline.from_pretrained(trained.folder)
    peer.set_progress_bar_config(disable=True)
    peer.load_lora_weights(str(trained.path), adapter_name="trained")
    peer.set_adapters(["trained"], [0.7])
    reference = peer(prompt=PROMPT, negative_prompt=WAN_DEFAULT_NEGATIVE_PROMPT, height=32, width=32, num_frames=5,
                     num_inference_steps=2, guidance_scale=4.0, generator=torch.Generator().manual_seed(7)).frames[0]
    np.testing.assert_allclose(merged, reference, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------ A14B experts

@pytest.fixture(scope="module")
def a14b(tiny_model, squares_dataset, tmp_path_factory) -> Trained:
    folder = tiny_model(A14B)
    tmp = tmp_path_factory.mktemp("train-a14b")
    # sigmoid_shift 12 as the T2V-A14B presets train (train() draws uniformly, which no shift changes): a step goes
    # to the high-noise expert when its routing sigma is at least the boundary 0.875, 1 step in 8 drawn uniformly
    # (6 steps miss it 45 % of the time), about 7 in 10 shifted
    trainer = train(tmp, folder, squares_dataset, steps=6,
                    overrides=[*TRAINING, "expert=both", "model_type=WAN_2_2", "timestep.distribution=sigmoid_shift",
                               "timestep.shift=12"])
    trained = Trained(trainer, tmp / "out.safetensors", folder)
    trained.weights_2 = lora_weights_from_peft(trained.model.transformer_2)
    assert all(module.up.abs().sum() > 0 for module in trained.weights_2.values())  # both experts trained
    return trained


def test_a14b_writes_one_file_per_expert(a14b):
    high, low = expert_lora_paths(a14b.path)
    assert sorted(p.name for p in a14b.path.parent.glob("out*.safetensors")) == [high.name, low.name]
    assert_same_weights(read_back(high, a14b.model.transformer), a14b.weights)
    assert_same_weights(read_back(low, a14b.model.transformer_2), a14b.weights_2)
    name = next(iter(a14b.weights))
    assert not torch.equal(a14b.weights[name].up, a14b.weights_2[name].up)  # two experts, two adapters
    assert metadata(high)["modelspec.architecture"] == metadata(low)["modelspec.architecture"]


def test_a14b_bare_name_goes_to_each_expert(a14b, tmp_path):
    """apply_lora_files and `convert_model.py --merge-lora` with the bare name put `_high_noise` into the high-noise
    expert and `_low_noise` into the low-noise one: the merged model generates what the trained model (both peft
    adapters live) generates."""
    model = load(a14b.folder)
    applied = apply_lora_files(model, [(a14b.path, 1.0)])
    assert [line.rsplit("-> ", 1)[1] for line in applied] == ["transformer", "transformer_2"]
    expected = pipeline_latents(a14b.model.create_pipeline())
    torch.testing.assert_close(pipeline_latents(model.create_pipeline()), expected, rtol=0, atol=ATOL)

    script = load_script()
    merged_folder = tmp_path / "merged"
    assert script.main(["--merge-lora", str(a14b.path), "--base-model-name", str(a14b.folder),
                        "--output-model-format", "DIFFUSERS", "--output-model-destination", str(merged_folder)]) == 0
    merged = load(merged_folder)
    for expert in ("transformer", "transformer_2"):
        ours, theirs = getattr(merged, expert).state_dict(), getattr(model, expert).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), expert


def test_a14b_pair_converts_both_files(a14b, tmp_path):
    target = tmp_path / "converted.safetensors"
    done = convert("--training-method", "LORA", "--input-name", a14b.path, "--output-model-format", "KOHYA_LORA",
                   "--output-model-destination", target)
    high, low = expert_lora_paths(target)
    assert done.stdout.split() == [str(high), str(low)]
    assert_same_weights(read_back(high, a14b.model.transformer), a14b.weights)
    assert_same_weights(read_back(low, a14b.model.transformer_2), a14b.weights_2)

    # naming one expert's file converts the pair too, into the destination's expert names
    script = load_script()
    again = tmp_path / "again_low_noise.safetensors"
    assert script.main(["--training-method", "LORA", "--input-name", str(low), "--output-model-format",
                        "COMFY_LORA", "--output-model-destination", str(again)]) == 0
    high_again, low_again = expert_lora_paths(tmp_path / "again.safetensors")
    assert_same_weights(read_back(high_again, a14b.model.transformer), a14b.weights)
    assert_same_weights(read_back(low_again, a14b.model.transformer_2), a14b.weights_2)


def test_convert_errors(tiny_model, tmp_path, capsys):
    """Exit 2 for arguments that do not fit together, 1 for a file that is not there (naming it)."""
    script = load_script()
    out = str(tmp_path / "out.safetensors")
    assert script.main(["--training-method", "LORA", "--input-name", out, "--output-model-format", "DIFFUSERS",
                        "--output-model-destination", out]) == 2
    assert "COMFY_LORA" in capsys.readouterr().err
    assert script.main(["--merge-lora", out, "--base-model-name", str(tiny_model(T2V)), "--output-model-format",
                        "COMFY_LORA", "--output-model-destination", out]) == 2
    assert script.main(["--input-name", str(tmp_path / "gone.safetensors"), "--output-model-format", "KOHYA_LORA",
                        "--output-model-destination", out]) == 1
    assert "gone_high_noise.safetensors" in capsys.readouterr().err
    assert script.main(["--merge-lora", str(tmp_path / "gone.safetensors:0.5"), "--base-model-name",
                        str(tiny_model(T2V)), "--output-model-format", "DIFFUSERS",
                        "--output-model-destination", str(tmp_path / "merged")]) == 1
    assert "gone.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def load_script():
    """scripts/convert_model.py as a module, for in-process calls that spare an interpreter start."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("convert_model_script", ROOT / "scripts" / "convert_model.py")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return script
