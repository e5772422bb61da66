"""A sharded (FSDP2) backup written before the first optimizer step (Ctrl-C at step 0) resumes exactly as a run that
never stopped: torch's get/set_optimizer_state_dict step a stateless optimizer once with zero gradients (Adam's
step=1), which changed both the running optimizer and the resumed one. One process on a gloo group of 1 shards the
tiny Wan transformer as distributed.py does (FSDP2 takes the same path at any world size)."""
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from modules.trainer.distributed_checkpoint import gather_backup_state, restore_backup_state


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_trainer(base) -> SimpleNamespace:
    """The parts of a GenericTrainer that gather / restore read: a fully_shard-ed transformer and its AdamW."""
    from torch.distributed.fsdp import fully_shard
    transformer = WanTransformer3DModel.from_pretrained(base / "transformer", torch_dtype=torch.float32)
    for block in transformer.blocks:
        fully_shard(block)
    fully_shard(transformer)
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-3)
    return SimpleNamespace(parallel=SimpleNamespace(sharded={"transformer": transformer}, is_main=True,
                                                    base_sharded=False, experts=None),   # a sharded fine-tune, not a frozen base
                           optimizer=optimizer, config=SimpleNamespace(batch_size=1, seed=0),
                           device=torch.device("cpu"))


def step(trainer) -> dict[str, torch.Tensor]:
    """One optimizer step on a fixed gradient (the same on every trainer); the resulting full weights."""
    transformer = trainer.parallel.sharded["transformer"]
    for name, parameter in transformer.named_parameters():
        gradient = torch.full(parameter.shape, 0.01 * (1 + len(name) % 7))
        parameter.grad = gradient if not hasattr(parameter, "device_mesh") else \
            torch.distributed.tensor.distribute_tensor(gradient, parameter.device_mesh, parameter.placements)
    trainer.optimizer.step()
    return {n: p.full_tensor().clone() for n, p in transformer.named_parameters()}


def test_backup_before_the_first_step_resumes_identically(tiny_model, gloo_group):
    base = tiny_model("wan2.1-t2v")
    stopped = sharded_trainer(base)
    trainable, optimizer_state, rng, _layout = gather_backup_state(stopped)
    # nothing to write, and the running optimizer was left as it was
    assert optimizer_state["state"] == {} and not stopped.optimizer.state
    assert [len(g["params"]) for g in optimizer_state["param_groups"]] == \
        [len(g["params"]) for g in stopped.optimizer.param_groups]

    uninterrupted = sharded_trainer(base)
    resumed = sharded_trainer(base)
    state = {"trainable": trainable, "optimizer": optimizer_state, "rng": rng, "progress": None}
    restore_backup_state(resumed, state)
    assert not resumed.optimizer.state     # before the fix: Adam state with step=1
    expected, got = step(uninterrupted), step(resumed)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    assert all(float(s["step"]) == 1 for s in resumed.optimizer.state.values())
