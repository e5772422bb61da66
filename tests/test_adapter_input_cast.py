"""A LoRA step under bf16 autocast leaves peft's cast of each adapter's input to float32 out (WanLoRASetup.
training_step): autocast narrows that copy again before the matmul, so the trained numbers are the same bit for bit
and the step holds less memory (the copy of the widest input, the FFN's, is the step's largest transient)."""
import contextlib

import torch
from safetensors.torch import load_file

from learning import train
from modules.modelSetup.WanLoRASetup import WanLoRASetup
from modules.planner.plan_shapes import PlanShape, resolve_architecture
from modules.planner.step_trace import trace_step
from modules.util.config.TrainConfig import TrainConfig

BF16 = ["train_dtype=BFLOAT_16", "output.dtype=FLOAT_32", "gradient_checkpointing=true"]


def with_input_cast(monkeypatch):
    monkeypatch.setattr(WanLoRASetup, "training_step", lambda self: contextlib.nullcontext())


def test_the_same_lora_bit_for_bit(tiny_model, squares_dataset, tmp_path, monkeypatch):
    without_cast = train(tmp_path / "a", tiny_model("wan2.1-t2v"), squares_dataset, "LORA", 3, BF16)
    with monkeypatch.context() as patch:
        with_input_cast(patch)
        with_cast = train(tmp_path / "b", tiny_model("wan2.1-t2v"), squares_dataset, "LORA", 3, BF16)
    assert without_cast.step_losses == with_cast.step_losses
    a, b = load_file(tmp_path / "a" / "out.safetensors"), load_file(tmp_path / "b" / "out.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") or "lora_up" in k for k in a)


def test_the_step_holds_less(tiny_model, monkeypatch):
    config = TrainConfig(model={"base_model_name": str(tiny_model("wan2.1-t2v"))}, train_dtype="BFLOAT_16",
                         training_method="LORA", gradient_checkpointing=True, lora={"rank": 4, "alpha": 4.0})
    arch = resolve_architecture(config)
    shape = PlanShape(batch_size=1, frames=33, height=256, width=256)
    without_cast, _ = trace_step(config, arch, shape, fake=False)   # a real CPU step, its storages counted
    with monkeypatch.context() as patch:
        with_input_cast(patch)
        with_cast, _ = trace_step(config, arch, shape, fake=False)
    assert without_cast.peak < with_cast.peak, (without_cast.breakdown(), with_cast.breakdown())
