"""Training a LoRA on a tiny Wan2.2-Animate-2 model: each step runs the extract pass over the driving video (with
gradients) and the cached pass over [reference slot + target]; the loss falls, never counts the reference slot (nor,
in a continuation run, the continuation frames), runs resume identically, and the saved LoRA changes diffusers'
`WanAnimate2Transformer3DModel` exactly as in training."""

import pytest
import torch
from diffusers import WanAnimate2Transformer3DModel
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
from safetensors import safe_open

from modules.util.demo_animate import make_animate_2_dataset
from tests.learning import assert_resumed_identically, train

COMMON = ["data.frame_buckets=[5]", "optimizer.learning_rate=0.01", "lora.rank=4", "lora.alpha=4", "batch_size=2"]


@pytest.fixture(scope="module")
def animate_2_set(tmp_path_factory):
    """Four clips (the red and green ones moving left and right) with their driving videos and references."""
    folder = make_animate_2_dataset(tmp_path_factory.mktemp("animate-2-set") / "data", clips_per_class=1, frames=5,
                                    size=32)
    for path in folder.iterdir():
        if not path.name.startswith(("red_left", "red_right", "green_left", "green_right")):
            path.unlink()
    return folder


@pytest.fixture(scope="module")
def trained(tiny_model, animate_2_set, tmp_path_factory):
    work = tmp_path_factory.mktemp("animate-2-train")
    trainer = train(work, tiny_model("wan2.2-animate-2"), animate_2_set, steps=8, overrides=COMMON)
    return trainer, work / "out.safetensors"


def _fixed_losses(trainer) -> float:
    setup = trainer.setup
    losses = []
    with torch.no_grad():
        for index, batch in enumerate(trainer.data.batches(0)):
            prediction = setup.predict(batch, torch.Generator().manual_seed(index))
            losses.append(float(setup.calculate_loss(batch, prediction)))
    return sum(losses) / len(losses)


def test_the_loss_falls(trained):
    trainer, _ = trained
    transformer = trainer.model.transformer.eval()
    after = _fixed_losses(trainer)
    transformer.disable_adapters()
    try:
        before = _fixed_losses(trainer)
    finally:
        transformer.enable_adapters()
    assert after < 0.8 * before, (before, after)


def _assert_loss_counts_from(trainer, batch, first: int):
    """Anything predicted on the latent frames before `first` changes nothing; on a later frame it does."""
    with torch.no_grad():
        prediction = trainer.setup.predict(batch, torch.Generator().manual_seed(0))
    loss = trainer.setup.calculate_loss(batch, prediction)
    prediction.predicted[:, :, :first] += 100.0
    assert trainer.setup.calculate_loss(batch, prediction) == loss
    prediction.predicted[:, :, first:] += 1.0
    assert trainer.setup.calculate_loss(batch, prediction) != loss


def test_the_loss_never_counts_the_reference_slot(trained):
    trainer, _ = trained
    batch = next(trainer.data.batches(0))
    assert batch["loss_mask"][0].flatten().tolist() == [0.0, 1.0, 1.0]
    _assert_loss_counts_from(trainer, batch, 1)


def test_a_continuation_run_leaves_the_continuation_frames_out_of_the_loss(tiny_model, tmp_path):
    """animate.continuation_frames=5 on 9-frame clips: each clip trains as a later segment continued from its own
    first 5 frames (latent frames 1 and 2 after the reference slot), which carry no loss; the last latent frame does."""
    data = make_animate_2_dataset(tmp_path / "data", clips_per_class=1, frames=9, size=32)
    for path in data.iterdir():
        if not path.name.startswith(("red_left", "green_right")):
            path.unlink()
    trainer = train(tmp_path, tiny_model("wan2.2-animate-2"), data, steps=1,
                    overrides=COMMON + ["data.frame_buckets=[9]", "animate.continuation_frames=5"])
    batch = next(trainer.data.batches(0))
    assert batch["loss_mask"][0].flatten().tolist() == [0.0, 0.0, 0.0, 1.0]
    assert batch["condition"][:, :4, :3].eq(1).all() and batch["condition"][:, :4, 3:].eq(0).all()
    _assert_loss_counts_from(trainer, batch, 3)


def _gradients(base, batch, checkpointing: bool) -> tuple[dict, torch.Tensor]:
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSetup.WanLoRASetup import WanLoRASetup
    from modules.util.config.ModelConfig import ModelConfig
    from modules.util.config.config_io import load_config
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base)))
    config = load_config(overrides=["model_type=WAN_2_2", "device=cpu", "train_dtype=FLOAT_32", "lora.rank=4",
                                    f"gradient_checkpointing={str(checkpointing).lower()}"])
    torch.manual_seed(0)
    setup = WanLoRASetup(config, model)
    setup.setup_model()
    setup.move_experts_to_device()
    for name, parameter in setup.named_trainable_parameters():   # B = 0 would give A no gradient
        if "lora_B" in name:
            torch.nn.init.normal_(parameter.data, std=0.1, generator=torch.Generator().manual_seed(1))
    batch = dict(batch, driving_latents=batch["driving_latents"].clone().requires_grad_(True))
    setup.calculate_loss(batch, setup.predict(batch, torch.Generator().manual_seed(0))).backward()
    return ({name: p.grad.clone() for name, p in setup.named_trainable_parameters()},
            batch["driving_latents"].grad)


def test_the_extract_pass_trains_also_under_checkpointing(trained, tiny_model):
    """The driving video reaches the loss through the KV cache, and checkpointed blocks (whose extract pass writes
    the cache as a side effect, recomputed in the backward pass) give the same gradients."""
    trainer, _ = trained
    batch = next(trainer.data.batches(0))
    plain, driving_plain = _gradients(tiny_model("wan2.2-animate-2"), batch, False)
    checkpointed, driving_checkpointed = _gradients(tiny_model("wan2.2-animate-2"), batch, True)
    assert driving_plain.abs().max() > 0
    torch.testing.assert_close(driving_checkpointed, driving_plain, rtol=1e-5, atol=1e-7)
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def _segment(transformer, lora_scale_inputs: int = 0):
    """One extract + cached pass of a 2-latent-frame segment at 4 x 4 latents, the pipeline's calls."""
    generator = torch.Generator().manual_seed(5 + lora_scale_inputs)
    frames, h, w = 2, 4, 4
    driving = torch.randn(16, frames, h, w, generator=generator)
    grid = torch.tensor([[frames, h // 2, w // 2]])
    cache = WanAnimate2KVCache(transformer.config.num_layers)
    text = torch.randn(512, transformer.config.text_dim, generator=generator)
    clip = torch.randn(1, 50, 1280, generator=generator)
    transformer([driving], torch.tensor([999.0]), [text], [torch.cat([torch.ones(4, frames, h, w), driving])],
                cache, "extract", seq_len=frames * h * w // 4, encoder_hidden_states_image=clip,
                offset_grid_sizes=grid)
    noisy = torch.randn(16, frames + 1, h, w, generator=generator)
    condition = torch.randn(20, frames + 1, h, w, generator=generator)
    return transformer([noisy], torch.tensor([600.0]), [text], [condition], cache, "cached",
                       seq_len=(frames + 1) * h * w // 4, encoder_hidden_states_image=clip,
                       reference_grid_sizes=grid, origin_len=(frames - 1) * 4 + 1, origin_area=[h * 8, w * 8]
                       ).sample[0]


def test_lora_loads_in_diffusers_and_changes_output_as_in_training(trained, tiny_model, tmp_path):
    from modules.util.enum.ModelFormat import ModelFormat
    trainer, comfy = trained
    with safe_open(str(comfy), framework="pt") as file:
        assert file.metadata()["modelspec.architecture"] == "wan_2_2_animate_2_14b/lora"
        assert any(k.startswith("diffusion_model.blocks.0.block.self_attn.q.") for k in file.keys())
    [written] = trainer.setup.save_result(str(tmp_path / "diffusers.safetensors"), ModelFormat.DIFFUSERS_LORA,
                                          torch.float32, None)
    with safe_open(str(written), framework="pt") as file:
        assert file.metadata()["modelspec.architecture"] == "wan_2_2_animate_2_14b/lora"
    ours = trainer.model.transformer.eval()
    theirs = WanAnimate2Transformer3DModel.from_pretrained(tiny_model("wan2.2-animate-2"), subfolder="transformer")
    with torch.no_grad():
        base = _segment(theirs)
        theirs.load_lora_adapter(str(written), prefix="transformer")
        trained_output = _segment(ours)
        torch.testing.assert_close(_segment(theirs), trained_output, rtol=0, atol=1e-5)
    assert (trained_output - base).abs().max() > 1e-3   # the LoRA changed the output


def test_the_comfy_file_reads_back_to_the_trained_adapter(trained, tiny_model):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSampler.sampling_io import apply_lora_files
    from modules.util.config.ModelConfig import ModelConfig
    trainer, comfy = trained
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate-2"))))
    apply_lora_files(model, [(comfy, 1.0)])
    with torch.no_grad():
        torch.testing.assert_close(_segment(model.transformer.eval()), _segment(trainer.model.transformer.eval()),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora_of,model_of", [("wan2.2-animate-2", "wan2.1-t2v"),
                                              ("wan2.1-t2v", "wan2.2-animate-2")])
def test_a_lora_of_another_model_is_refused_before_its_weights_load(trained, tiny_model, tmp_path, monkeypatch,
                                                                    lora_of, model_of):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSampler.WanModelSampler import SampleError
    from modules.modelSampler.sampling_io import load_model_for_sampling
    from modules.util.enum.DataType import DataType
    from modules.util.lora.formats import save_lora_file
    from modules.util.lora.LoraModule import LoraModule
    from modules.util.enum.ModelFormat import ModelFormat
    from modules.util.enum.WanVariant import WanVariant
    from modules.util.modelspec import modelspec_metadata
    if lora_of == "wan2.2-animate-2":
        lora = trained[1]
    else:
        lora = tmp_path / "t2v.safetensors"
        save_lora_file({"blocks.0.attn1.to_q": LoraModule(torch.zeros(4, 32), torch.zeros(32, 4), 4.0)},
                       ModelFormat.COMFY_LORA, lora, metadata=modelspec_metadata(WanVariant.T2V, lora=True))
    monkeypatch.setattr(WanBaseModelLoader, "load", lambda *_: pytest.fail("the weights were loaded"))
    names = {"wan2.2-animate-2": "wan_2_2_animate_2_14b", "wan2.1-t2v": "wan_2_1_t2v"}
    with pytest.raises(SampleError, match=f"made for {names[lora_of]} .*the model is .*"
                                          f"{names[model_of]}.*only on its Animate"):
        load_model_for_sampling(str(tiny_model(model_of)), DataType.FLOAT_32, torch.device("cpu"),
                                loras=[(lora, 1.0)])


def test_an_animate_2_run_resumes_from_its_backup_identically(tiny_model, animate_2_set, tmp_path):
    base = tiny_model("wan2.2-animate-2")
    # 4 clips / batch 2 = 2 batches an epoch: step 3 is mid-epoch; one cache for the three runs
    common = COMMON + ["backup.every_n_steps=3", f"cache_dir={tmp_path / 'cache'}"]
    full = train(tmp_path / "full", base, animate_2_set, steps=4, overrides=common)
    first = train(tmp_path / "split", base, animate_2_set, steps=3, overrides=common)
    resumed = train(tmp_path / "split", base, animate_2_set, steps=4,
                    overrides=common + ["backup.continue_last_backup=true"])
    assert_resumed_identically(full, first, resumed, 4)


def test_replace_mode_is_refused_for_animate_2_before_anything_loads(tiny_model, tmp_path):
    from modules.trainer.prepare import prepare_config
    from modules.util.config.ConfigError import ConfigError
    from modules.util.config.config_io import load_config
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.2-animate-2')}", "model_type=WAN_2_2",
                                    f'data.concepts=[{{"path": "{tmp_path}"}}]', "device=cpu",
                                    "train_dtype=FLOAT_32", "animate.mode=replace"])
    with pytest.raises(ConfigError, match="animate.mode: replace .* is ANIMATE_2_14B, which animates only"):
        prepare_config(config)


def test_the_gpu_block_mask_allows_what_the_dense_mask_allows():
    """The CUDA path (compiled flex attention over `_block_mask`) attends the keys the CPU path's dense mask does:
    uncompiled flex attention (forward only on the CPU) with that block mask equals the dense path."""
    from torch.nn.attention.flex_attention import flex_attention

    from modules.model.animate_2_attention import _block_mask, in_context_attention
    generator = torch.Generator().manual_seed(0)
    frames, reference_frames, hw = 3, 2, 6   # generation [reference slot + 2 frames], 2 driving frames
    query = torch.randn(1, 2, frames * hw, 8, generator=generator)
    key, value = (torch.randn(1, 2, (frames + reference_frames) * hw, 8, generator=generator) for _ in range(2))
    mask = _block_mask(frames, reference_frames, hw, "cpu")
    torch.testing.assert_close(flex_attention(query, key, value, block_mask=mask),
                               in_context_attention(query, key, value, frames, reference_frames, hw),
                               rtol=1e-5, atol=1e-6)


def test_a_full_fine_tune_saves_in_the_official_layout_and_loads_back(tiny_model, animate_2_set, tmp_path):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    base = tiny_model("wan2.2-animate-2")
    trainer = train(tmp_path, base, animate_2_set, "FINE_TUNE", 1, COMMON)
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as file:
        assert "blocks.0.block.self_attn.q.weight" in set(file.keys())
    loaded = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base),
                                                   transformer=PartConfig(path=str(tmp_path / "out.safetensors"))))
    untrained = WanBaseModelLoader().load(ModelConfig(base_model_name=str(base))).transformer
    with torch.no_grad():
        trained_output = _segment(trainer.model.transformer.eval())
        torch.testing.assert_close(_segment(loaded.transformer), trained_output, rtol=0, atol=1e-5)
        assert (_segment(untrained) - trained_output).abs().max() > 1e-4   # the step changed it
