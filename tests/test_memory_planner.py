"""The memory planner (modules/planner, issue 21): its trace of a training step on fake tensors against the same
step run for real, and its predictions at real size. Real-size plans trace the full model on fake tensors: a few
seconds each, nothing computed."""
import pytest
import torch

from modules.planner.plan_shapes import PlanShape
from modules.planner.step_trace import trace_step
from modules.util.config.TrainConfig import TrainConfig

GIB = 1024 ** 3
TINY_SHAPE = PlanShape(batch_size=1, frames=33, height=256, width=256)

SWITCHES = {
    "lora": dict(training_method="LORA", gradient_checkpointing=False),
    "fine-tune": dict(training_method="FINE_TUNE", gradient_checkpointing=False),
    "checkpoint every 1": dict(training_method="LORA", gradient_checkpointing=True),
    "checkpoint every 2": dict(training_method="LORA", gradient_checkpointing=True,
                               performance={"checkpoint_every": 2}),
    "block swap": dict(training_method="LORA", gradient_checkpointing=True, performance={"block_swap": 1}),
    "activation offload": dict(training_method="LORA", gradient_checkpointing=True,
                               performance={"activation_offload": True}),
}


def tiny_config(folder, **values) -> TrainConfig:
    return TrainConfig(**{"model": {"base_model_name": str(folder)}, "train_dtype": "BFLOAT_16",
                          "optimizer": {"optimizer": "ADAMW"}, "lora": {"rank": 4, "alpha": 4.0}, **values})


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_prediction_matches_a_real_cpu_step(tiny_model, switches):
    """The planner's peak (fake tensors) is within 5 % of what the same step allocates for real on the CPU, counted
    by the same counter (the real step uses the setup's own predict; the planner its fake-tensor twin)."""
    from modules.planner.plan_shapes import resolve_architecture
    config = tiny_config(tiny_model("wan2.1-t2v"), **SWITCHES[switches])
    arch = resolve_architecture(config)
    torch.manual_seed(0)
    real, _ = trace_step(config, arch, TINY_SHAPE, fake=False)
    planned, _ = trace_step(config, arch, TINY_SHAPE, fake=True)
    assert real.peak > 0
    assert abs(planned.peak - real.peak) <= 0.05 * real.peak, (
        f"{switches}: planned {planned.peak} bytes, real {real.peak} bytes; "
        f"planned {planned.breakdown()}, real {real.breakdown()}")


# ---------------------------------------------------------------------------------------------------- real size

def preset_config(name: str, *overrides: str) -> TrainConfig:
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    return load_config(preset_path=resolve_preset(name), overrides=overrides)


@pytest.fixture(scope="module")
def plans_13b():
    """1.3B LoRA r32 (the 16GB preset's setup) at 832x480, planned once per setting."""
    from modules.planner.memory_plan import predict
    cache = {}

    def get(frames: int = 81, **values):
        key = (frames, tuple(sorted(values.items())))
        if key not in cache:
            overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
            config = preset_config("wan 2.1 1.3B LoRA 16GB", *overrides)
            cache[key] = predict(config, PlanShape(1, frames, 480, 832))
        return cache[key]
    return get


def test_more_checkpointing_never_predicts_more(plans_13b):
    off = plans_13b(17, gradient_checkpointing=False)
    every_2 = plans_13b(17, **{"gradient_checkpointing": True, "performance.checkpoint_every": 2})
    every_1 = plans_13b(17, **{"gradient_checkpointing": True, "performance.checkpoint_every": 1})
    assert off.traced_bytes > every_2.traced_bytes > every_1.traced_bytes


def test_more_swapped_blocks_never_predict_more(plans_13b):
    none = plans_13b(17, **{"performance.checkpoint_every": 1})
    ten = plans_13b(17, **{"performance.block_swap": 10})
    twenty = plans_13b(17, **{"performance.block_swap": 20})
    assert none.traced_bytes > ten.traced_bytes > twenty.traced_bytes
    assert twenty.host_pinned_bytes > ten.host_pinned_bytes > 0
    # each swapped 1.3B block holds about 1/30 of the 2.6 GiB bf16 weights: 10 blocks ~ 0.9 GiB off the device
    assert 0.7 * GIB < ten.parts["weights"] - twenty.parts["weights"] < 1.0 * GIB


def test_doubling_frames_roughly_doubles_activations(plans_13b):
    """41 -> 81 frames: 11 -> 21 latent frames (x1.9 tokens); without checkpointing the saved activations grow with
    the tokens (attention's saved tensors are linear in them: flash-style kernels keep no L x L matrix)."""
    short = plans_13b(41, gradient_checkpointing=False)
    long = plans_13b(81, gradient_checkpointing=False)
    ratio = long.parts["activations"] / short.parts["activations"]
    assert 1.6 < ratio < 2.3, ratio


# Peers' published figure for Wan 2.1 1.3B LoRA at 832x480x81 with gradient checkpointing, as issue 21 states it:
# 4.7 GiB. The one public report found offline is musubi-tuner issue #150 (github.com/kohya-ss/musubi-tuner/
# issues/150): "~10GB VRAM" for a 1.3B LoRA at 61 frames on a 16 GB card (resolution not given).
PEER_13B_LORA_GIB = 4.7


@pytest.mark.xfail(strict=True, reason="the planner predicts ~12.7 GiB for diffusers' WanTransformer3DModel here: "
                   "its blocks upcast to float32 (norms, rope, residual adds), and the backward pass of one "
                   "recomputed block at 32,760 tokens holds ~6 GiB; 2.7x the 4.7 GiB peers quote (not yet measured "
                   "on a GPU: `benchmark proof` will say whether the planner or the figure is off)")
def test_13b_lora_within_2x_of_peers(plans_13b):
    prediction = plans_13b(81, **{"gradient_checkpointing": True, "performance.checkpoint_every": 1})
    assert PEER_13B_LORA_GIB / 2 <= prediction.peak_gib <= PEER_13B_LORA_GIB * 2, prediction.report()
