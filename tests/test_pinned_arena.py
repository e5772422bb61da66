"""Block swap's host copies in one exact-size arena and activation offload's block inputs in reused exact-size
buffers (modules/util/pinned_arena.py) instead of PyTorch's power-of-two pinned blocks: the same training step bit
for bit, the bytes the planner counts, and the CUDA registration's calls (the registration itself needs a CUDA
device; here the cudart module is replaced by a recorder, every other part runs for real on the CPU)."""
import functools
import gc

import pytest
import torch

import modules.modelSetup.memory.PerformanceSetup as performance_setup
from modules.modelSetup.memory.ActivationOffload import ActivationOffload
from modules.modelSetup.memory.BlockSwap import BlockSwap
from modules.util.pinned_arena import ALIGNMENT, PAGE, PinnedArena, PinnedBuffer, PinnedPool, layout
from tests.test_memory_features import ARCH, one_step


def assert_identical(result, reference):
    assert torch.equal(result[0], reference[0])
    assert result[1].keys() == reference[1].keys()
    for name in result[1]:
        assert torch.equal(result[1][name], reference[1][name]), name


@pytest.mark.parametrize("fp8", [False, True])
def test_block_swap_from_one_arena_gives_the_same_step_bit_for_bit(monkeypatch, fp8):
    """The host copies as the parameters' own tensors (before) and as views into one arena: the same step; with
    fp8 layerwise storage the arena holds the float8 weights."""
    dtype = "BFLOAT_16" if fp8 else "FLOAT_32"   # fp8 storage computes in bf16
    reference = one_step(performance={"block_swap": 2}, dtype=dtype, fp8=fp8)
    monkeypatch.setattr(performance_setup, "BlockSwap", functools.partial(BlockSwap, arena=True))
    result = one_step(performance={"block_swap": 2}, dtype=dtype, fp8=fp8)
    assert_identical(result, reference)
    swap = result[2].performance["transformer"].block_swap
    hosts = [host for index in swap.indices for _, host in swap.host[index]]
    # every host copy is a view into the one arena, at an aligned offset, and the arena is their exact size
    base = swap.arena.buffer.bytes.data_ptr()
    assert all(base <= h.data_ptr() < base + swap.arena.nbytes and (h.data_ptr() - base) % ALIGNMENT == 0
               for h in hosts)
    assert swap.arena.nbytes == layout(hosts)[1] < sum(h.numel() * h.element_size() for h in hosts) + \
        ALIGNMENT * len(hosts)
    assert any(h.dtype == torch.float8_e4m3fn for h in hosts) == fp8
    # between uses the parameters are the arena's views again
    assert all(p.data_ptr() == h.data_ptr() for index in swap.indices for p, h in swap.host[index])


def test_activation_offload_from_a_pool_gives_the_same_steps_and_reuses_its_buffers(monkeypatch):
    reference = one_step(performance={"activation_offload": True}, checkpointing=True)
    monkeypatch.setattr(performance_setup, "ActivationOffload", functools.partial(ActivationOffload, pooled=True))
    result = one_step(performance={"activation_offload": True}, checkpointing=True)
    assert_identical(result, reference)
    offload = result[2].performance["transformer"].offload
    gc.collect()
    # both blocks' inputs, (1, 12 tokens, 64) float32 each, in buffers of their exact size, back in the pool
    assert offload.pool.created == 2 and offload.pool.held_bytes == 2 * 12 * 64 * 4
    # a second forward and backward pass takes the same buffers again
    setup, transformer = result[2], result[2].model.transformer
    generator = torch.Generator().manual_seed(2)
    latent = torch.randn(1, 16, 3, 4, 4, generator=generator)
    batch = {"latents": latent, "text_embeds": torch.randn(1, 512, ARCH.text_dim, generator=generator)}
    setup.calculate_loss(batch, setup.predict(batch, torch.Generator().manual_seed(1))).backward()
    gc.collect()
    assert offload.pool.created == 2 and offload.pool.held_bytes == 2 * 12 * 64 * 4


def test_the_pool_serves_smaller_requests_from_larger_buffers_and_drops_smaller_free_ones():
    pool = PinnedPool(pin=False)
    small = [pool.take(1000) for _ in range(2)]
    for buffer in small:
        pool.give(buffer)
    large = [pool.take(3000), pool.take(3000)]   # the free 1000-byte buffers are dropped, not kept beside them
    assert pool.created == 4 and pool.free == []
    for buffer in large:
        pool.give(buffer)
    again = pool.take(1000)   # a smaller input takes a larger free buffer: no new one
    assert again.nbytes == 3000 and pool.created == 4
    view = pool.tensor(again, torch.Size((5, 50)), torch.float32)
    assert view.shape == (5, 50) and view.data_ptr() == again.bytes.data_ptr()


class _Recorder:
    """Stands for torch.cuda.cudart() (no CUDA device here): records the registrations."""

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def cudaHostRegister(self, pointer, size, flags):
        self.calls.append(("register", pointer, size, flags))
        return 1 if self.refuse else 0

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", pointer))
        return 0


def test_an_arena_registers_once_its_exact_page_aligned_range_and_unregisters_once(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    tensors = [torch.arange(1001, dtype=torch.uint8), torch.randn(3, 7, dtype=torch.bfloat16)]
    arena = PinnedArena(tensors)
    for view, tensor in zip(arena.views, tensors):
        view.copy_(tensor)
    assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(arena.views, tensors))
    assert recorder.calls == []
    assert arena.lock() and arena.lock()   # a second lock is a no-op
    pointer = arena.buffer.bytes.data_ptr()
    assert pointer % PAGE == 0
    assert recorder.calls == [("register", pointer, 1024 + 64, 0)]   # 1001 -> 1024 (aligned), 42 bytes -> 64
    arena.release()
    arena.release()
    assert recorder.calls[1:] == [("unregister", pointer)]
    assert torch.equal(arena.views[0], tensors[0])   # still readable: ordinary memory now


def test_a_collected_buffer_is_unregistered_and_a_refused_one_is_left_pageable(monkeypatch, caplog):
    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    buffer = PinnedBuffer(5000)
    buffer.lock()
    pointer = buffer.bytes.data_ptr()
    del buffer
    gc.collect()
    assert recorder.calls == [("register", pointer, 5000, 0), ("unregister", pointer)]
    refusing = _Recorder(refuse=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refusing)
    buffer = PinnedBuffer(5000)
    assert not buffer.lock() and "could not be page-locked" in caplog.text
    buffer.release()
    assert [call[0] for call in refusing.calls] == ["register"]


def test_block_swap_release_unregisters_its_arena(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3)).requires_grad_(False)
    swap = BlockSwap(blocks, 2, torch.device("cpu"), arena=True)
    swap.arena.lock()   # what the CUDA path does after filling it
    pointer = swap.arena.buffer.bytes.data_ptr()
    swap.remove()
    assert recorder.calls == [("register", pointer, 2 * 320, 0), ("unregister", pointer)]   # 2 x (256 B + 64 B)
    assert swap.arena is None


@pytest.mark.parametrize("name", ["wan 2.1 14B LoRA 24GB"])
def test_the_planner_counts_the_swapped_blocks_at_their_exact_size(name):
    from modules.planner.host_plan import GIB, _swapped_block_bytes, plan_host
    from modules.planner.plan_shapes import resolve_architecture
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    config = load_config(None, resolve_preset(name), [])
    exact, arena = _swapped_block_bytes(config, resolve_architecture(config))
    step = plan_host(config, cuda=True).phases["training step"]
    assert step["swapped blocks (pinned)"] == arena and exact <= arena < exact + 0.001 * GIB


def test_the_pool_frees_its_buffers_on_release_and_the_next_step_is_the_same(monkeypatch):
    """Before a backup or the final save the setup frees activation offload's buffers (unregistered on CUDA); the
    next step makes them again and computes the same loss and gradients bit for bit."""
    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    pool = PinnedPool(pin=True)
    buffers = [pool.take(4096), pool.take(4096)]
    for buffer in buffers:
        pool.give(buffer)
    pointers = [buffer.bytes.data_ptr() for buffer in buffers]
    pool.clear()
    assert pool.free == [] and pool.held_bytes == 0
    assert [call for call in recorder.calls if call[0] == "unregister"] == [("unregister", p) for p in pointers]

    monkeypatch.setattr(performance_setup, "ActivationOffload", functools.partial(ActivationOffload, pooled=True))
    result = one_step(performance={"activation_offload": True}, checkpointing=True)
    setup, transformer = result[2], result[2].model.transformer
    offload = setup.performance["transformer"].offload

    def step():
        generator = torch.Generator().manual_seed(2)
        batch = {"latents": torch.randn(1, 16, 3, 4, 4, generator=generator),
                 "text_embeds": torch.randn(1, 512, ARCH.text_dim, generator=generator)}
        transformer.zero_grad(set_to_none=True)
        loss = setup.calculate_loss(batch, setup.predict(batch, torch.Generator().manual_seed(1)))
        loss.backward()
        gc.collect()
        return loss.detach(), {n: p.grad.clone() for n, p in transformer.named_parameters() if p.requires_grad}
    kept = step()
    assert offload.pool.held_bytes == 2 * 12 * 64 * 4
    setup.release_host_buffers()
    assert offload.pool.held_bytes == 0
    again = step()
    assert offload.pool.created == 4   # made again
    assert_identical(again, kept)


def test_a_backup_and_the_final_save_run_without_the_offload_buffers(tiny_model, tmp_path, monkeypatch):
    """A real CPU run with activation offload from the pool: when the backup and the final save write, the pool
    holds no buffer (its host memory is room for their copies, not kept beside them)."""
    import modules.trainer.GenericTrainer as generic
    from modules.trainer.prepare import prepare_config
    from modules.util.config.config_io import load_config
    from modules.util.demo_assets import make_t2v_dataset
    monkeypatch.setattr(performance_setup, "ActivationOffload", functools.partial(ActivationOffload, pooled=True))
    dataset = make_t2v_dataset(tmp_path / "clips")
    config = load_config(overrides=[
        f"model.base_model_name={tiny_model('wan2.1-t2v')}", f"workspace_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}", f"output.destination={tmp_path / 'out.safetensors'}", "device=cpu",
        "gradient_checkpointing=true", "performance.activation_offload=true", "max_steps=2", "epochs=10",
        "backup.every_n_steps=1", f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]",
        "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0", "tensorboard=false"])
    trainer = generic.GenericTrainer(config, e2v_datasets=prepare_config(config))
    held = []

    def pools():
        return [s.offload.pool for s in trainer.setup.performance.values() if s.offload is not None]
    from modules.modelSetup.WanLoRASetup import WanLoRASetup
    write_backup, save_result = generic.write_backup, WanLoRASetup.save_result

    def recording_backup(*args, **kwargs):
        held.append(("backup", sum(pool.held_bytes for pool in pools()), sum(pool.created for pool in pools())))
        return write_backup(*args, **kwargs)

    def recording_save(setup, *args, **kwargs):
        held.append(("save", sum(pool.held_bytes for pool in pools()), sum(pool.created for pool in pools())))
        return save_result(setup, *args, **kwargs)
    monkeypatch.setattr(generic, "write_backup", recording_backup)
    monkeypatch.setattr(WanLoRASetup, "save_result", recording_save)
    trainer.train()
    assert [entry[0] for entry in held][:2] == ["backup", "backup"] and held[-1][0] == "save", held
    assert all(entry[1] == 0 for entry in held), held        # nothing held while writing
    assert held[1][2] > held[0][2] > 0, held                 # the second step made its buffers again
