"""Host memory while loading and converting: no part is ever held whole in a second copy."""
import numpy as np
import pytest
import torch

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelLoader.wan.WanPartsLoader import WanPartsLoader
from modules.modelLoader.wan.parts.model_plan import plan_model
from modules.util.config.ModelConfig import ModelConfig, PartConfig
from modules.util.enum.DataType import DataType
from tests.host_memory_tracking import AliveBytes, module_bytes


def _diffusers_loader(config, folder):
    return WanBaseModelLoader()._load_transformer(config.transformer, str(folder), "transformer",
                                                  dict(local_files_only=True, use_safetensors=True))


def _parts_loader(config, folder):
    # a tokenizer named apart sends a diffusers base through the parts loader
    config = config.model_copy(update={"tokenizer": PartConfig(path=str(folder / "tokenizer"))})
    return WanPartsLoader._transformer(plan_model(config), "transformer", config.transformer)


@pytest.mark.parametrize("load", [_diffusers_loader, _parts_loader], ids=["diffusers-folder", "parts-loader"])
def test_a_folder_transformer_read_as_float8_is_never_held_whole_in_bfloat16(tiny_model, load):
    """FLOAT_8 from a full-precision diffusers folder: each tensor goes from the mapped file to float8 as it is
    read; loading in bfloat16 and casting afterwards held the whole model in bfloat16 beside the float8 copy."""
    folder = tiny_model("wan2.1-t2v")
    config = ModelConfig(base_model_name=str(folder), transformer=PartConfig(weight_dtype=DataType.FLOAT_8))
    with AliveBytes() as counter:
        transformer = load(config, folder)
    assert transformer.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    final = module_bytes(transformer)
    largest = max(p.numel() for p in transformer.parameters()) * 4   # one tensor in float32, on its way
    assert counter.peak <= 1.1 * final + largest, (counter.peak, final, largest)


def test_a_folder_transformer_read_as_float8_holds_the_numbers_bfloat16_then_float8_gave(tiny_model):
    """The streamed read rounds as loading in bfloat16 and then storing in float8 did: the same tensors, dtypes
    and outputs."""
    from diffusers import WanTransformer3DModel
    folder = tiny_model("wan2.1-t2v")
    config = ModelConfig(base_model_name=str(folder), transformer=PartConfig(weight_dtype=DataType.FLOAT_8))
    ours = _diffusers_loader(config, folder)
    theirs = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    theirs.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    a, b = ours.state_dict(), theirs.eval().state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float()) for k in a)
    generator = torch.Generator().manual_seed(0)
    channels, text = ours.config.in_channels, ours.config.text_dim
    inputs = dict(hidden_states=torch.randn(1, channels, 2, 8, 8, generator=generator, dtype=torch.bfloat16),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, text, generator=generator, dtype=torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(ours(**inputs, return_dict=False)[0], theirs(**inputs, return_dict=False)[0])


def test_convert_model_keeps_a_bfloat16_models_dtypes_and_size(tiny_model, tmp_path):
    """No --output-dtype keeps each tensor's dtype (as its help says): a bf16 model is read in bf16 and written as a
    bf16 file of the input's size, the same numbers; it was read in float32 and written twice as large."""
    import sys
    from pathlib import Path
    from safetensors import safe_open
    from modules.util.lora.keys import diffusers_to_original_state_dict
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import convert_model
    bf16 = tmp_path / "bf16"
    assert convert_model.main(["--input-name", str(tiny_model("wan2.1-t2v")), "--output-model-format", "DIFFUSERS",
                               "--output-model-destination", str(bf16), "--output-dtype", "BFLOAT_16"]) == 0
    source = bf16 / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(source), "pt") as f:
        original = diffusers_to_original_state_dict({k: f.get_tensor(k) for k in f.keys()})
    assert {v.dtype for v in original.values()} == {torch.bfloat16}
    out = tmp_path / "wan_bf16.safetensors"
    assert convert_model.main(["--input-name", str(bf16), "--output-model-format", "ORIGINAL",
                               "--output-model-destination", str(out)]) == 0
    with safe_open(str(out), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert written.keys() == original.keys()
    assert all(written[k].dtype == v.dtype and torch.equal(written[k], v) for k, v in original.items())
    assert out.stat().st_size <= 1.05 * source.stat().st_size, (out.stat().st_size, source.stat().st_size)


def test_the_text_encoder_is_released_after_caching_and_previews_still_run(tiny_model, squares_dataset, tmp_path,
                                                                          monkeypatch):
    """Once the prompts' embeddings are cached training needs no text encoder: the text pass runs first and the
    encoder is dropped (its memory returned) before the VAE pass, and each preview reads it again for its prompts
    and drops it after."""
    import gc
    import json
    import weakref
    from learning import train
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.trainer.GenericTrainer import GenericTrainer
    held, passes = {}, []
    release, cache_epoch = GenericTrainer._release_text_encoder, WanBaseDataLoader._cache_epoch

    def release_and_watch(self):
        held["parameter"] = weakref.ref(next(self.model.text_encoder.parameters()))
        held["passes before"] = list(passes)
        return release(self)

    def cache_epoch_and_watch(self, epoch, encoder, *args, **kwargs):
        passes.append(type(encoder).__name__)
        return cache_epoch(self, epoch, encoder, *args, **kwargs)

    monkeypatch.setattr(GenericTrainer, "_release_text_encoder", release_and_watch)
    monkeypatch.setattr(WanBaseDataLoader, "_cache_epoch", cache_epoch_and_watch)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9,
                                    "steps": 2, "seed": 1}]))
    trainer = train(tmp_path / "previews", tiny_model("wan2.1-t2v"), squares_dataset, steps=2,
                    overrides=[f"sampling.samples_file={samples}", "sampling.every_n_steps=1",
                               "sampling.sample_before_training=true"])
    assert trainer.hooks.sampler.failures == 0
    # released after the text pass, before the VAE pass
    assert held["passes before"] == ["EncodeText"] and passes == ["EncodeText", "EncodeVideo"], passes
    gc.collect()
    assert held["parameter"]() is None
    assert trainer.model.text_encoder is None
    assert len(sorted((tmp_path / "previews" / "run" / "samples").rglob("*.mp4"))) == 3
    trainer.data.rebuild()   # as a resume on another world size does, after the release
    # a pipeline built from the trained model reads it again, the same weights
    reloaded = trainer.model.create_pipeline(image_mode=False).text_encoder.state_dict()
    source = WanBaseModelLoader().load(trainer.config.model).text_encoder.state_dict()
    assert reloaded.keys() == source.keys() and all(torch.equal(reloaded[k], source[k]) for k in source)


def test_a_fine_tunes_diffusers_folder_still_holds_the_released_text_encoder(tiny_model, squares_dataset, tmp_path):
    """The text encoder released after caching is read again for a diffusers save: the folder holds it unchanged."""
    from safetensors.torch import load_file
    from learning import train
    base = tiny_model("wan2.1-t2v")
    out = tmp_path / "out"
    trainer = train(tmp_path / "ft", base, squares_dataset, method="FINE_TUNE", steps=1,
                    overrides=["output.format=DIFFUSERS", f"output.destination={out}"])
    assert trainer.model.text_encoder is None
    written = load_file(str(next((out / "text_encoder").glob("*.safetensors"))))
    source = load_file(str(next((base / "text_encoder").glob("*.safetensors"))))
    assert written.keys() == source.keys() and all(torch.equal(written[k], source[k]) for k in source)


def test_preview_rounds_read_the_text_encoder_again_only_for_new_prompts(tiny_model, squares_dataset, tmp_path,
                                                                         monkeypatch):
    """The previews' prompt embeddings are kept when the text encoder is released: three preview rounds read no
    encoder at all; a prompt the samples file gains reads it once, the next round none; and a preview from the kept
    embeddings equals the one made with the encoder read again."""
    import json
    from learning import train
    from modules.modelLoader.wan import WanBaseModelLoader as loader_module
    from modules.modelSampler.TrainingSampler import TrainingSampler
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.config.SampleConfig import SampleConfig
    reads = []
    load_only = loader_module.load_text_encoder_only

    def counted(*args, **kwargs):
        reads.append(1)
        return load_only(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_text_encoder_only", counted)
    samples = tmp_path / "samples.json"
    first = {"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9, "steps": 2, "seed": 1,
             "guidance": 3.0}
    samples.write_text(json.dumps([first]))
    trainer = train(tmp_path / "previews", tiny_model("wan2.1-t2v"), squares_dataset, steps=2,
                    overrides=[f"sampling.samples_file={samples}", "sampling.every_n_steps=1",
                               "sampling.sample_before_training=true"])
    assert trainer.hooks.sampler.failures == 0
    assert len(sorted((tmp_path / "previews" / "run" / "samples").rglob("*.mp4"))) == 3
    assert reads == [] and trainer.model.text_encoder is None

    samples.write_text(json.dumps([first, {**first, "prompt": "a blue square moving right"}]))
    sampler = TrainingSampler(trainer)
    sampler.sample_all()
    assert len(reads) == 1 and trainer.model.text_encoder is None
    sampler.sample_all()
    assert len(reads) == 1

    sample = SampleConfig(**{**first, "prompt": "a blue square moving right"})
    kept = WanModelSampler(trainer.model).sample(sample).frames
    trainer.model.prompt_memo.clear()
    read_again = WanModelSampler(trainer.model).sample(sample).frames
    assert len(reads) == 2
    np.testing.assert_array_equal(kept, read_again)


_RELEASE_RSS = """
import gc, json, sys, types
from functools import partial
import psutil, torch
torch.set_num_threads(1)
from modules.model.released_parts import release_text_encoder
from modules.modelLoader.wan.WanBaseModelLoader import load_text_encoder_only
from modules.util.config.ModelConfig import ModelConfig, PartConfig
config = ModelConfig(base_model_name=sys.argv[1], text_encoder=PartConfig(path=sys.argv[2]))
process = psutil.Process()
gc.collect()
before = process.memory_info().rss
model = types.SimpleNamespace(text_encoder=load_text_encoder_only(config), text_encoder_loader=None)
with torch.no_grad():   # as caching runs it: every weight read, activations made and freed
    model.text_encoder(input_ids=torch.randint(0, 1000, (1, 64))).last_hidden_state.sum()
size = sum(p.numel() * p.element_size() for p in model.text_encoder.parameters())
held = process.memory_info().rss
release_text_encoder(model, partial(load_text_encoder_only, config))
print(json.dumps(dict(size=size, before=before, held=held, after=process.memory_info().rss)))
"""


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32], ids=["bf16-file", "fp32-file-read-as-bf16"])
def test_releasing_the_text_encoder_returns_its_memory_to_the_system(tiny_model, tmp_path, stored):
    """The process's RSS (psutil, in a process of its own) falls by most of the encoder's size when it is released
    after caching, for weights mapped from a bf16 file and for weights cast as read into memory of their own."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from transformers import UMT5Config, UMT5EncoderModel
    torch.manual_seed(0)
    # ~70 MB in bfloat16: far above the allocator's and the interpreter's noise
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=4096, d_model=1024, d_kv=64, d_ff=4096, num_layers=2,
                                          num_heads=16, feed_forward_proj="gated-gelu"))
    encoder.to(stored).save_pretrained(tmp_path / "text_encoder")
    del encoder
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", _RELEASE_RSS, str(tiny_model("wan2.1-t2v")),
                             str(tmp_path / "text_encoder")], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    assert rss["held"] - rss["before"] >= 0.9 * rss["size"], rss   # the measure sees the encoder
    assert rss["held"] - rss["after"] >= 0.8 * rss["size"], rss


@pytest.fixture(scope="module")
def saved_forms(tiny_model, tmp_path_factory):
    """The tiny T2V transformer as a bf16 diffusers folder, a bf16 single file and a float8 single file."""
    from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
    from modules.util.enum.ModelFormat import ModelFormat
    folder = tmp_path_factory.mktemp("forms")
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    WanBaseModelSaver().save(model, ModelFormat.DIFFUSERS, folder / "bf16", torch.bfloat16)
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        WanBaseModelSaver().save(model, ModelFormat.ORIGINAL, folder / f"{name}.safetensors", dtype)
    return folder


@pytest.mark.parametrize("weight_dtype", [DataType.BFLOAT_16, DataType.FLOAT_8], ids=["as-bf16", "as-fp8"])
@pytest.mark.parametrize("form", ["folder-bf16", "file-bf16", "file-fp8"])
def test_reading_a_transformer_never_holds_a_second_whole_copy(saved_forms, tiny_model, form, weight_dtype):
    """Every form a transformer is read from, in both stored dtypes: the tensors alive while it is read never add up
    to much more than the model it becomes (one tensor in float32 on its way)."""
    if form == "folder-bf16":
        config = ModelConfig(base_model_name=str(saved_forms / "bf16"), transformer=PartConfig(weight_dtype=weight_dtype))
        loads = [_diffusers_loader, _parts_loader]
        source = saved_forms / "bf16"
    else:
        path = saved_forms / f"{form.removeprefix('file-')}.safetensors"
        config = ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v")),
                             transformer=PartConfig(path=str(path), weight_dtype=weight_dtype))
        loads = [lambda config, _folder: WanPartsLoader._transformer(plan_model(config), "transformer",
                                                                     config.transformer)]
        source = None
    for load in loads:
        with AliveBytes() as counter:
            transformer = load(config, source)
        stored = transformer.blocks[0].attn1.to_q.weight.dtype
        # an fp8 file stays float8 whatever dtype is asked (docs/formats.md)
        float8 = weight_dtype is DataType.FLOAT_8 or form == "file-fp8"
        assert stored == (torch.float8_e4m3fn if float8 else torch.bfloat16)
        final = module_bytes(transformer)
        largest = max(p.numel() for p in transformer.parameters()) * 4
        assert counter.peak <= 1.1 * final + largest, (load, counter.peak, final, largest)
