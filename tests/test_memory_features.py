"""Issue 12: every memory and speed switch that runs on the CPU leaves a fixed-seed training step unchanged: the same
loss and the same gradients (exactly, up to float32 summation order, in float32; within bf16 noise under bf16
autocast) as the plain step. Each test also proves that the switch was really active (blocks recomputed, weights
swapped in and out, activations offloaded), so a switch that silently did nothing would fail."""
import pytest
import torch

from modules.benchmark.architectures import build_empty_transformer, get_architecture, make_wan_model, materialize
from modules.modelSetup.WanFineTuneSetup import WanFineTuneSetup
from modules.modelSetup.WanLoRASetup import WanLoRASetup
from modules.util.config.TrainConfig import TrainConfig

ARCH = get_architecture("tiny")          # 2 blocks, d 64: one step is a few milliseconds
LATENT = ARCH.latent_shape(9, 32, 32)    # (16, 3, 4, 4): 12 video tokens


def one_step(performance: dict | None = None, checkpointing: bool = False, dtype: str = "FLOAT_32",
             fp8: bool = False, method: str = "LORA", layer_filter: list[str] | None = None):
    """The loss, the gradients by name and the setup of one step of the tiny transformer (weights seed 0, batch and
    noise seed 1) with the given switches."""
    torch.manual_seed(0)   # peft draws the adapters' initial weights from the global generator
    transformer = materialize(build_empty_transformer(ARCH), torch.float32, torch.device("cpu"), seed=0)
    transformer.requires_grad_(False)
    if fp8:
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    values = dict(gradient_checkpointing=checkpointing, train_dtype=dtype, performance=performance or {},
                  lora={"rank": 4, "alpha": 4.0}, training_method=method)
    if layer_filter:
        values["fine_tune"] = {"layer_filter": layer_filter}
    config = TrainConfig(**values)
    setup = (WanLoRASetup if method == "LORA" else WanFineTuneSetup)(config, make_wan_model(ARCH, transformer))
    setup.setup_model()
    setup.move_experts_to_device()
    generator = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(1, *LATENT, generator=generator),
             "text_embeds": torch.randn(1, 512, ARCH.text_dim, generator=generator)}
    calls = [0] * len(transformer.blocks)
    for index, block in enumerate(transformer.blocks):
        # a pre-hook: a recomputation stops as soon as it has what the backward pass needs, before the block ends
        block.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    loss = setup.calculate_loss(batch, setup.predict(batch, torch.Generator().manual_seed(1)))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in transformer.named_parameters() if p.requires_grad}
    assert grads, "nothing trained"
    return loss.detach(), grads, setup, calls


@pytest.fixture(scope="module")
def plain():
    return one_step()


def assert_same_step(result, reference, atol=1e-6, rtol=1e-5):
    loss, grads = result[0], result[1]
    torch.testing.assert_close(loss, reference[0], atol=atol, rtol=rtol)
    assert grads.keys() == reference[1].keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference[1][name], atol=atol, rtol=rtol, msg=name)


def test_checkpointing_every_block_and_every_other_block(plain):
    assert plain[3] == [1, 1]   # no checkpointing: each block runs once
    every = one_step(checkpointing=True)
    assert_same_step(every, plain)
    assert every[3] == [2, 2]   # recomputed in the backward pass
    other = one_step(checkpointing=True, performance={"checkpoint_every": 2})
    assert_same_step(other, plain)
    assert other[3] == [2, 1]   # block 0 checkpointed, block 1 keeps its activations


def test_block_swap_loads_weights_only_while_a_block_runs(plain):
    seen = []

    def watch(setup):
        swap = setup.performance["transformer"].block_swap
        linear = swap.blocks[1].attn1.to_q.base_layer
        host = dict((id(p), h) for p, h in swap.host[1])[id(linear.weight)]
        linear.register_forward_pre_hook(lambda *_: seen.append(linear.weight.data_ptr() != host.data_ptr()))
        return linear, host

    import modules.modelSetup.BaseWanSetup as base
    original = base.BaseWanSetup.move_experts_to_device
    watched = {}

    def move_and_watch(self):
        original(self)
        watched["linear"], watched["host"] = watch(self)

    base.BaseWanSetup.move_experts_to_device = move_and_watch
    try:
        result = one_step(performance={"block_swap": 1})
    finally:
        base.BaseWanSetup.move_experts_to_device = original
    assert_same_step(result, plain)
    swap = result[2].performance["transformer"].block_swap
    assert swap.indices == [1] and result[3] == [1, 2]     # the swapped block is checkpointed, the other is not
    # in the forward pass and in the recomputation the block ran on a device copy; afterwards only the host copy
    # is left
    assert seen == [True, True]
    assert watched["linear"].weight.data_ptr() == watched["host"].data_ptr() and not swap.resident
    # the adapters of the swapped block stayed where training keeps them
    assert all(p.data_ptr() not in {h.data_ptr() for _, h in swap.host[1]}
               for n, p in swap.blocks[1].named_parameters() if "lora_" in n)


def test_activation_offload_with_checkpointing(plain):
    result = one_step(checkpointing=True, performance={"activation_offload": True})
    assert_same_step(result, plain)
    offload = result[2].performance["transformer"].offload
    # both blocks' inputs went to the host: (1, 12 tokens, 64) float32 each
    assert offload.bytes_offloaded == 2 * 12 * 64 * 4 and offload.order == []


@pytest.mark.parametrize("dtype", ["FLOAT_32", "BFLOAT_16"])
def test_recomputed_norms_give_the_same_step_bit_for_bit(dtype):
    """performance.recompute_norms (on by default) against off, with and without block checkpointing: the same loss
    and gradients bit for bit; under bf16 autocast the blocks no longer keep a float32 copy of any activation for
    the backward pass (only the output norm, outside the blocks, still does)."""
    width = ARCH.transformer["num_attention_heads"] * ARCH.transformer["attention_head_dim"]
    for checkpointing in (False, True):
        steps, float32_kept = {}, {}
        for switch in (False, True):
            kept = []

            def pack(tensor, kept=kept):
                if tensor.dtype == torch.float32 and tensor.dim() == 3 and tensor.shape[1] > 1 \
                        and tensor.shape[2] == width:
                    kept.append(tensor.shape)   # a float32 activation (tokens x width) kept for the backward pass
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                steps[switch] = one_step(checkpointing=checkpointing, dtype=dtype,
                                         performance={"recompute_norms": switch})
            float32_kept[switch] = len(kept)
        on, off = steps[True], steps[False]
        assert torch.equal(on[0], off[0])
        assert on[1].keys() == off[1].keys()
        for name, grad in on[1].items():
            assert torch.equal(grad, off[1][name]), name
        # 2 blocks x (norm1-3 and the RMS norms of both attentions' queries and keys)
        assert on[2].performance["transformer"].norms_recomputed == 14
        assert off[2].performance["transformer"].norms_recomputed == 0
        if dtype == "BFLOAT_16" and not checkpointing:   # a checkpoint hides its block's saved tensors from `pack`
            assert float32_kept[False] > 12 and float32_kept[True] == 1, float32_kept


def test_everything_at_once_and_the_math_attention_kernel(plain):
    result = one_step(checkpointing=True, performance={"block_swap": 2, "activation_offload": True,
                                                       "checkpoint_every": 2, "attention": "math"})
    assert_same_step(result, plain)
    assert result[3] == [2, 2]


def test_fine_tune_of_the_blocks_that_are_not_swapped():
    reference = one_step(method="FINE_TUNE", layer_filter=["blocks.0."])
    result = one_step(method="FINE_TUNE", layer_filter=["blocks.0."], performance={"block_swap": 1})
    assert_same_step(result, reference)
    with pytest.raises(ValueError, match=r"block 1 is swapped but trains"):
        one_step(method="FINE_TUNE", performance={"block_swap": 1})


def test_bf16_fp8_storage_with_block_swap_and_offload():
    """fp8 layerwise storage (bf16 compute) composes with block swap and activation offload: the same bf16 step."""
    reference = one_step(checkpointing=True, dtype="BFLOAT_16", fp8=True)
    result = one_step(checkpointing=True, dtype="BFLOAT_16", fp8=True,
                      performance={"block_swap": 1, "activation_offload": True})
    swap = result[2].performance["transformer"].block_swap
    assert {h.dtype for _, h in swap.host[1]} >= {torch.float8_e4m3fn}
    assert_same_step(result, reference, atol=1e-3, rtol=1e-2)
    # and fp8 storage itself stays within bf16 noise of bf16 weights... of fp8-rounded weights: only the loss is
    # compared, against a bf16 step without any switch
    bf16 = one_step(dtype="BFLOAT_16")
    torch.testing.assert_close(result[0], bf16[0], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_attention_kernels_that_run_on_the_cpu(plain, kernel):
    result = one_step(performance={"attention": kernel})
    from modules.modelSetup.memory.PerformanceSetup import ATTENTION_BACKENDS
    backend = result[2].model.transformer.blocks[0].attn1.processor._attention_backend
    assert str(getattr(backend, "value", backend)) == ATTENTION_BACKENDS[kernel]
    assert_same_step(result, plain, atol=1e-5, rtol=1e-4)


def test_gpu_only_settings_on_a_cpu_are_config_errors_before_loading(tiny_model, monkeypatch):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.trainer.prepare import prepare_config
    from modules.util.config.config_io import ConfigError, load_config

    monkeypatch.setattr(WanBaseModelLoader, "load", lambda *a: pytest.fail("a model loaded"))
    config = load_config(overrides=[f"model.base_model_name={tiny_model('wan2.1-t2v')}", "device=cpu",
                                    "model.transformer.weight_dtype=NF4", "model.vae.weight_dtype=INT8",
                                    "performance.attention=cudnn", "gradient_checkpointing=false",
                                    "performance.activation_offload=true", "performance.block_swap=2"])
    with pytest.raises(ConfigError) as error:
        prepare_config(config)
    problems = error.value.problems
    assert any(p.startswith("model.transformer.weight_dtype: NF4") and "CUDA GPU only" in p for p in problems)
    assert any(p.startswith("model.vae.weight_dtype: INT8") and "transformer weights only" in p for p in problems)
    assert any(p.startswith("performance.attention: 'cudnn'") for p in problems)
    assert any(p.startswith("performance.activation_offload:") for p in problems)
    assert any(p.startswith("performance.block_swap: 2 swaps every one of the model's 2 blocks") for p in problems)
    assert any(p.startswith("data.concepts: no enabled concept") for p in problems)   # no data given here
    assert len(problems) == 6


def test_losses_read_back_every_n_steps_and_a_nan_is_still_caught(tiny_model, squares_dataset, tmp_path,
                                                                  monkeypatch):
    from learning import train
    from modules.modelSetup.BaseWanSetup import BaseWanSetup
    from modules.trainer.backup_io import all_backups
    from modules.trainer.GenericTrainer import GenericTrainer, TrainingError

    base = tiny_model("wan2.1-t2v")
    cache = f"cache_dir={tmp_path / 'cache'}"
    reads = []
    read_losses = GenericTrainer.read_losses

    def counting(self):
        reads.append(len(self.pending_losses))
        read_losses(self)

    monkeypatch.setattr(GenericTrainer, "read_losses", counting)
    every_third = train(tmp_path / "a", base, squares_dataset, steps=6,
                        overrides=[cache, "performance.loss_readback_steps=3"])
    assert [n for n in reads if n] == [3, 3]   # two reads of three steps each, not one per step
    # VAE tiling rides along: the cache is already filled by the first run, and 32x32 clips are below one tile
    every_step = train(tmp_path / "b", base, squares_dataset, steps=6,
                       overrides=[cache, "performance.loss_readback_steps=1", "performance.vae_tiling=true"])
    assert len(every_third.step_losses) == 6 and every_third.step_losses == every_step.step_losses
    assert every_step.model.vae.use_tiling and not every_third.model.vae.use_tiling

    calculate_loss, calls = BaseWanSetup.calculate_loss, []

    def poisoned(self, batch, prediction):
        calls.append(1)
        loss = calculate_loss(self, batch, prediction)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(BaseWanSetup, "calculate_loss", poisoned)
    # read every 5 steps, backups every 3: the NaN of step 4 is found at step 5's read, and named as step 4
    with pytest.raises(TrainingError, match=r"at step 4 .*step-00000003"):
        train(tmp_path / "c", base, squares_dataset, steps=8,
              overrides=[cache, "performance.loss_readback_steps=5", "backup.every_n_steps=3"])
    assert [b.name for b in all_backups(tmp_path / "c" / "run" / "backup")] == ["step-00000003"]


def test_regional_compilation_of_the_blocks(plain, monkeypatch):
    """performance.compile_blocks compiles each block in place (parameter names, and so LoRA keys, unchanged). On
    the CPU the graphs are captured with dynamo's eager backend (the same tracing, no C++ code generation)."""
    from modules.modelSetup.memory.PerformanceSetup import PerformanceSetup
    init = PerformanceSetup.__init__

    def eager(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "compile_backend": "eager"})

    monkeypatch.setattr(PerformanceSetup, "__init__", eager)
    torch._dynamo.reset()
    result = one_step(checkpointing=True, performance={"compile_blocks": True, "checkpoint_every": 2})
    assert result[2].performance["transformer"].compiled == [0, 1]
    assert result[1].keys() == plain[1].keys()
    assert_same_step(result, plain)


def test_an_attention_kernel_is_set_for_the_trained_transformer_only():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    before = _AttentionBackendRegistry._active_backend
    one_step(performance={"attention": "math"})
    assert _AttentionBackendRegistry._active_backend == before
