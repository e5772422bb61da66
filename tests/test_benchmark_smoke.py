"""scripts/benchmark.py (DESIGN.md section 8): the FLOP counter against a hand count and against torch's own
counter, the train subcommand on the tiny transformer, the memory guard, and the data subcommand on two tiny
clips. A smoke test of a benchmark, not a timing: no speed is asserted."""
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modules.benchmark import train_bench
from modules.benchmark.architectures import build_empty_transformer, get_architecture, make_wan_model, materialize
from modules.benchmark.flops import count_flops

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def benchmark_main():
    """scripts/benchmark.py's main(argv), imported in-process (its imports are the test process's)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module.main


# The tiny transformer (tiny_models: d = 2 heads x 32 = 64, FFN 256, 2 layers, text_dim 32, 16 -> 16 channels,
# patch 1x2x2) on a 9x64x64 clip: latents 16x3x8x8, L = 3 * 4 * 4 = 48 video tokens, S = 512 text tokens.
# Per block:
#   self-attention q, k, v, out on L tokens    4 * 2*64*64 * 48      =  1,572,864
#   cross-attention q, out on L tokens         2 * 2*64*64 * 48      =    786,432
#   cross-attention k, v on S tokens           2 * 2*64*64 * 512     =  8,388,608
#   feed-forward 64 -> 256 -> 64 on L          2 * 2*64*256 * 48     =  3,145,728
#   attention products: self 4*L^2*d, cross 4*L*S*d
#                                              4*48*48*64 + 4*48*512*64 = 6,881,280
#   LoRA rank 4 on all ten Linears:            2*4*(64+64)*48*6 + 2*4*(64+64)*512*2 + 2*4*(64+256)*48*2
#                                              = 294,912 + 1,048,576 + 245,760 = 1,589,248
# Outside the blocks:
#   patch embedding 16*1*2*2 -> 64 on L        2*64*64*48            =    393,216
#   text embedder 32 -> 64 -> 64 on S          2*(32*64 + 64*64)*512 =  6,291,456
#   time embedder 256 -> 64 -> 64, proj 64 -> 384, one timestep
#                                              2*(256*64 + 64*64 + 64*384) = 90,112
#   output projection 64 -> 16*4 on L          2*64*64*48            =    393,216
HAND_BLOCK_LINEAR = 2 * (1_572_864 + 786_432 + 8_388_608 + 3_145_728)
HAND_ATTENTION = 2 * 6_881_280
HAND_LORA = 2 * 1_589_248
HAND_OUTER = 393_216 + 6_291_456 + 90_112 + 393_216
HAND_FORWARD = HAND_BLOCK_LINEAR + HAND_ATTENTION + HAND_LORA + HAND_OUTER   # 51,896,320


def test_flop_count_is_the_hand_count_and_torchs_count():
    arch = get_architecture("tiny")
    latent = arch.latent_shape(9, 64, 64)
    assert latent == (16, 3, 8, 8)
    flops = count_flops(arch.transformer, *latent[1:], lora_rank=4, lora_targets="attn-mlp", checkpointing=True)
    assert (flops.blocks_linear, flops.blocks_attention, flops.blocks_lora, flops.outer) == (
        HAND_BLOCK_LINEAR, HAND_ATTENTION, HAND_LORA, HAND_OUTER)
    assert flops.forward == HAND_FORWARD == 51_896_320
    assert flops.model == 3 * HAND_FORWARD
    assert flops.hardware == 3 * HAND_FORWARD + HAND_BLOCK_LINEAR + HAND_ATTENTION + HAND_LORA

    # the same number as torch's FLOP counter on the real module with the adapters the LoRA setup adds (the
    # math attention backend runs attention as counted matmuls)
    from modules.modelSetup.WanLoRASetup import WanLoRASetup
    from modules.util.config.TrainConfig import TrainConfig

    transformer = materialize(build_empty_transformer(arch), torch.float32, torch.device("cpu"))
    transformer.requires_grad_(False)
    setup = WanLoRASetup(TrainConfig(lora={"rank": 4, "alpha": 4.0, "targets": "attn-mlp"},
                                     gradient_checkpointing=False), make_wan_model(arch, transformer))
    setup.setup_model()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(hidden_states=torch.randn(1, *latent), timestep=torch.tensor([500.0]),
                    encoder_hidden_states=torch.randn(1, 512, arch.text_dim), return_dict=False)
    assert counter.get_total_flops() == HAND_FORWARD


def test_train_subcommand_on_the_tiny_transformer(benchmark_main, tmp_path):
    out = tmp_path / "train.json"
    code = benchmark_main(["train", "--variant", "tiny", "--width", "64", "--height", "64", "--frames", "9",
                           "--steps", "1", "--dtype", "fp32", "--lora-rank", "4", "--device", "cpu",
                           "--peak-tflops", "0.5", "--no-recompute-norms", "--chunk-tokens", "0", "--json",
                           str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and len(result["step_seconds"]) == 1 and len(result["losses"]) == 2
    # --no-recompute-norms, --chunk-tokens 0: the switches on by default, off
    assert result["features"] == "no memory features"
    assert all(math.isfinite(v) for v in result["losses"])
    assert result["latent_shape"] == [16, 3, 8, 8] and result["video_tokens"] == 48
    assert result["flops"]["forward"] == HAND_FORWARD and result["flops"]["model"] == 3 * HAND_FORWARD
    # trainable: rank 4 x (in + out) per wrapped Linear, as peft made them
    assert result["trainable_parameters"] == 2 * 4 * (8 * 128 + 2 * 320)
    assert result["mfu"] == pytest.approx(3 * HAND_FORWARD / result["seconds_per_step"] / 0.5e12)
    assert result["memory"]["peak_rss_gib"] > 0


def test_train_refuses_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(train_bench, "available_memory_bytes", lambda device: 1024)
    monkeypatch.setattr(train_bench, "materialize", lambda *a, **k: pytest.fail("allocated despite the estimate"))
    with pytest.raises(train_bench.InsufficientMemory, match=r"needs about .* GiB"):
        train_bench.run_train_benchmark(train_bench.TrainBenchConfig(variant="tiny", width=64, height=64, frames=9))


def test_data_subcommand_on_two_tiny_clips(benchmark_main, tmp_path):
    out = tmp_path / "data.json"
    code = benchmark_main(["data", "--clips", "2", "--width", "64", "--height", "64", "--frames", "9",
                           "--source-seconds", "1", "--repeats", "1", "--warm-epochs", "1",
                           "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["bare"]["decoded_frames"] == 2 * 30
    ours = result["ours"]
    # 9 frames at 16 fps from 30 fps: source frames floor(j * 30 / 16), j = 0..8, the last 15: 16 decoded per clip
    assert ours["output_frames"] == 2 * 9 and ours["decoded_frames"] == 2 * 16
    assert ours["video_shapes"] == [[3, 9, 64, 64]]
    assert result["ratio_ours_to_bare_clips_per_second"] > 0
    cached = result["cached"]
    assert cached["encoder_calls_filling"] == 4   # two clips, two distinct captions
    assert cached["encoder_calls_warm"] == 0 and cached["warm_items"] == 2
    assert cached["latent_batch_shape"] == [1, 16, 3, 8, 8]


def test_train_memory_and_speed_options_and_the_baseline(benchmark_main, tmp_path):
    out = tmp_path / "train.json"
    code = benchmark_main(["train", "--variant", "tiny", "--width", "64", "--height", "64", "--frames", "9",
                           "--steps", "1", "--dtype", "fp32", "--lora-rank", "4", "--device", "cpu",
                           "--peak-tflops", "0.5", "--gradient-checkpointing", "--checkpoint-every", "2",
                           "--block-swap", "1", "--activation-offload", "--attention", "math", "--baseline",
                           "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok"
    assert result["features"] == ("checkpointing 2/2 blocks, block swap 1 (blocks 1-1), activation offload, "
                                  "attention math, norms recomputed, per-token parts in chunks of 4096 tokens")
    assert result["tokens_per_second"] == pytest.approx(48 / result["seconds_per_step"])
    # block 0 checkpointed by the dial, block 1 because it is swapped: both recomputed
    assert result["flops"]["hardware"] == 3 * HAND_FORWARD + HAND_BLOCK_LINEAR + HAND_ATTENTION + HAND_LORA
    assert result["hfu"] == pytest.approx(result["flops"]["hardware"] / result["seconds_per_step"] / 0.5e12)
    baseline = result["baseline"]
    assert baseline["status"] == "ok" and baseline["seconds_per_step"] > 0
    assert baseline["trainable_parameters"] == result["trainable_parameters"]   # the same adapters
    assert result["speedup_vs_baseline"] == pytest.approx(baseline["seconds_per_step"] / result["seconds_per_step"])


def test_memory_cap_is_for_cuda(benchmark_main, capsys):
    code = benchmark_main(["train", "--variant", "tiny", "--width", "64", "--height", "64", "--frames", "9",
                           "--device", "cpu", "--memory-cap-gib", "4"])
    assert code == 2 and "--memory-cap-gib caps CUDA memory" in capsys.readouterr().err


def test_presets_run_with_their_switches_under_their_promised_memory(benchmark_main, capsys):
    assert benchmark_main(["presets", "--dry-run"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    big = lines["#wan 2.1 14B LoRA 24GB"]
    for switch in ("--variant wan2.1-14b", "--weight-dtype fp8", "--block-swap 34", "--activation-offload",
                   "--gradient-checkpointing", "--memory-cap-gib 22.0", "--frames 81"):
        assert switch in big
    assert "--memory-cap-gib 15.0" in lines["#wan 2.1 1.3B LoRA 16GB"]
    assert "--checkpoint-every 1" in lines["#wan 2.1 1.3B LoRA 24GB"]  # the planner: every 3rd needs ~80 GiB
    assert "--full" in lines["#wan 2.1 1.3B fine-tune"]
    assert lines["#wan 2.1 I2V 14B LoRA"].startswith("not run:")


def test_the_cpu_peak_probe_takes_seconds_not_minutes():
    from modules.benchmark.common import measure_matmul_tflops
    started = time.perf_counter()
    rate = measure_matmul_tflops(torch.device("cpu"), torch.bfloat16, budget_seconds=0.2)
    assert rate > 0 and time.perf_counter() - started < 3.0


@pytest.mark.parametrize("guidance, full_passes", [(5.0, 6), (1.0, 3)])
def test_the_preview_benchmark_times_both_ways_in_one_run(benchmark_main, tmp_path, guidance, full_passes):
    """`benchmark preview`: the full-step preview (two passes per step with guidance) and the accelerated one (one
    pass per accelerator step), timed on one transformer, and their ratio (the numbers themselves are not checked:
    speed belongs to the benchmark, not to tests)."""
    out = tmp_path / "preview.json"
    assert benchmark_main(["preview", "--variant", "tiny", "--width", "32", "--height", "32", "--frames", "5",
                           "--steps", "3", "--guidance", str(guidance), "--accelerator-steps", "2", "--rank", "4",
                           "--dtype", "fp32", "--device", "cpu", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["full"]["model_passes"] == full_passes and result["accelerated"]["model_passes"] == 2
    assert result["accelerated"]["what"] == "2 steps, guidance 1, rank 4"
    full, fast = result["full"]["seconds_per_preview"], result["accelerated"]["seconds_per_preview"]
    assert full > 0 and fast > 0 and result["speedup"] == pytest.approx(full / fast)
    assert benchmark_main(["preview", "--variant", "tiny", "--steps", "0"]) == 2
