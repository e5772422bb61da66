"""Seconds per preview with and without an accelerator, measured in one run on one transformer, and their ratio
(docs/distilled.md, docs/benchmarks.md).

A preview's denoising loop is timed both ways, the rest of a preview (text encoding, VAE decode) being the same for
both and left out:
- full: the sample's own steps on the flow-matching Euler scheduler (`shift`), two model passes per step when the
  guidance is above 1 (the negative prompt's and the prompt's);
- accelerated: inside `accelerated()` (the accelerator's low-rank modules as hooks on the base layers, its bias deltas
  added), on the accelerator's schedule (`AcceleratorScheduler`, LightX2V's 4 steps by default), one pass per step.
The accelerator is random (no weights exist offline): rank `rank` pairs on every attention and FFN Linear of the
blocks and a `.diff_b` on each, the layout of lightx2v's distill LoRAs; its cost does not depend on its values.
Each way runs once to warm up, then `repeats` times; the median is reported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.benchmark.architectures import (TEXT_SEQUENCE_LENGTH, build_empty_transformer, get_architecture,
                                             make_wan_model, materialize)
from modules.benchmark.common import environment, median, synchronize


@dataclass
class PreviewBenchConfig:
    variant: str = "wan2.1-1.3b"
    width: int = 832
    height: int = 480
    frames: int = 81
    steps: int = 30                # the full-step preview's steps
    guidance: float = 5.0          # above 1: two passes per full step
    shift: float = 5.0             # the full-step scheduler's flow shift
    accelerator_steps: int = 4
    rank: int = 64                 # lightx2v's distill LoRAs are rank 64
    dtype: str = "bf16"
    device: str = "cpu"
    repeats: int = 2
    seed: int = 0


def random_accelerator(transformer: torch.nn.Module, rank: int, steps: int, generator: torch.Generator):
    """An Accelerator over `transformer`: a rank-`rank` pair and a bias delta on every block attention / FFN Linear."""
    from modules.modelSampler.accelerator import Accelerator
    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    from modules.util.lora.accelerator_files import AcceleratorFile
    from modules.util.lora.LoraModule import LoraModule
    lora, deltas = {}, {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks.") and (".attn" in name or ".ffn" in name):
            lora[name] = LoraModule(down=torch.randn(rank, module.in_features, generator=generator) * 0.01,
                                    up=torch.randn(module.out_features, rank, generator=generator) * 0.01,
                                    alpha=float(rank))
            deltas[f"{name}.bias"] = torch.randn(module.out_features, generator=generator) * 0.01
    file = AcceleratorFile(Path(f"random rank-{rank} accelerator"), lora, deltas, "benchmark")
    return Accelerator(AcceleratorConfig(file=str(file.path), steps=steps), {"transformer": file})


def _denoise(transformer, scheduler, steps: int, guidance: float, latents, text, negative, device) -> int:
    """One preview's denoising loop; the model passes it made."""
    scheduler.set_timesteps(steps, device=device)
    passes = 0
    for t in scheduler.timesteps:
        timestep = t.expand(latents.shape[0]).to(device)
        velocity = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                               return_dict=False)[0]
        passes += 1
        if guidance > 1:
            unconditional = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=negative,
                                        return_dict=False)[0]
            velocity = unconditional + guidance * (velocity - unconditional)
            passes += 1
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    return passes


def run_preview_benchmark(cfg: PreviewBenchConfig, log=print) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from modules.modelSampler.accelerator import accelerated
    arch = get_architecture(cfg.variant)
    if arch.expand_timesteps:
        raise ValueError(f"{cfg.variant}: per-token timesteps are not timed here; pick a Wan 2.1 or A14B shape")
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    transformer = materialize(build_empty_transformer(arch), dtype, device, seed=cfg.seed).eval()
    model = make_wan_model(arch, transformer)
    generator = torch.Generator().manual_seed(cfg.seed)
    accelerator = random_accelerator(transformer, cfg.rank, cfg.accelerator_steps, generator)
    shape = arch.latent_shape(cfg.frames, cfg.height, cfg.width)
    noise = torch.randn(1, *shape, generator=generator).to(device, dtype)
    text = torch.randn(1, TEXT_SEQUENCE_LENGTH, arch.text_dim, generator=generator).to(device, dtype)
    negative = torch.randn(1, TEXT_SEQUENCE_LENGTH, arch.text_dim, generator=generator).to(device, dtype)

    def full() -> int:
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)
        return _denoise(transformer, scheduler, cfg.steps, cfg.guidance, noise, text, negative, device)

    def fast() -> int:
        with accelerated(model, accelerator):
            return _denoise(transformer, accelerator.scheduler(), accelerator.steps, 1.0, noise, text, negative,
                            device)

    result = {"variant": cfg.variant, "width": cfg.width, "height": cfg.height, "frames": cfg.frames,
              "latent_shape": list(shape), "dtype": cfg.dtype, "device": cfg.device, "rank": cfg.rank,
              "environment": environment()}
    for name, run, what in (("full", full, f"{cfg.steps} steps, guidance {cfg.guidance:g}"),
                            ("accelerated", fast, f"{accelerator.steps} steps, guidance 1, rank {cfg.rank}")):
        times, passes = [], 0
        with torch.no_grad():
            for repeat in range(cfg.repeats + 1):
                synchronize(device)
                start = time.perf_counter()
                passes = run()
                synchronize(device)
                if repeat:   # the first run warms up
                    times.append(time.perf_counter() - start)
        result[name] = {"what": what, "model_passes": passes, "seconds_per_preview": median(times),
                        "seconds_per_pass": median(times) / passes}
        log(f"preview {name} ({what}): {median(times):.3f} s, {passes} model passes")
    result["speedup"] = result["full"]["seconds_per_preview"] / result["accelerated"]["seconds_per_preview"]
    return result


def preview_table(result: dict) -> str:
    from modules.benchmark.common import format_table
    rows = [[name, result[name]["what"], result[name]["model_passes"], f"{result[name]['seconds_per_preview']:.3f}",
             f"{result[name]['seconds_per_pass']:.3f}"] for name in ("full", "accelerated")]
    return (format_table(["preview", "schedule", "passes", "s / preview", "s / pass"], rows) +
            f"\n{result['variant']} {result['width']}x{result['height']}x{result['frames']} on {result['device']}: "
            f"the accelerated preview is {result['speedup']:.1f}x faster (denoising only; text encoding and the VAE "
            f"decode are the same both ways)")
