"""The baseline: the plain diffusers + peft LoRA step a user could write in an afternoon (the seed 004 workflow), at
the train benchmark's shape, timed in the same process right after it for a side-by-side ratio.

What it does is what such a script does: the transformer in the weight dtype on the device, `add_adapter` with a
peft LoraConfig on the same Linear layers, diffusers' own gradient checkpointing when the benchmark checkpoints,
torch's default AdamW, noise and sigmas drawn on the host and copied, bf16 autocast, MSE against noise - x0, and
the loss read back every step. None of this project's memory or speed features.
"""
from __future__ import annotations

import time

import torch

from modules.benchmark.architectures import (TEXT_SEQUENCE_LENGTH, Architecture, build_empty_transformer,
                                             materialize)
from modules.benchmark.common import GIB, median, synchronize

# the block-relative Linear names of each LoRA target preset, as peft suffixes
PEFT_TARGETS = {"attn-only": ["to_q", "to_k", "to_v", "to_out.0"],
                "attn-mlp": ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]}


def run_baseline(arch: Architecture, cfg, device: torch.device, weight_dtype: torch.dtype, log=print) -> dict:
    """Seconds per step, tokens per second and peak memory of the plain step (see the module doc)."""
    from peft import LoraConfig

    if cfg.full or cfg.lora_targets not in PEFT_TARGETS:
        return {"status": f"no baseline for {'a full fine-tune' if cfg.full else cfg.lora_targets}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    transformer = materialize(build_empty_transformer(arch), weight_dtype, device, seed=cfg.seed)
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank,
                                       target_modules=PEFT_TARGETS[cfg.lora_targets]))
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.data = parameter.data.float()
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    latent = arch.latent_shape(cfg.frames, cfg.height, cfg.width)
    generator = torch.Generator().manual_seed(cfg.seed)
    latents = torch.randn(cfg.batch_size, *latent, generator=generator)
    text = torch.randn(cfg.batch_size, TEXT_SEQUENCE_LENGTH, arch.text_dim, generator=generator)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    times, status = [], "ok"
    try:
        for step in range(cfg.steps + 1):
            synchronize(device)
            start = time.perf_counter()
            noise = torch.randn(latents.shape, generator=generator)
            sigma = torch.rand(cfg.batch_size, generator=generator).view(-1, 1, 1, 1, 1)
            noisy = ((1 - sigma) * latents + sigma * noise).to(device)
            timestep = (sigma.flatten() * 1000).to(device)
            if arch.expand_timesteps:   # TI2V-5B: one timestep per token
                tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
                timestep = timestep[:, None].expand(-1, tokens)
            with autocast:
                predicted = transformer(hidden_states=noisy, timestep=timestep,
                                        encoder_hidden_states=text.to(device), return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(predicted.float(), (noise - latents).to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            synchronize(device)
            if step > 0:
                times.append(time.perf_counter() - start)
            log(f"baseline step {step}{' (warm-up)' if step == 0 else ''}: {time.perf_counter() - start:.2f} s")
    except torch.OutOfMemoryError as error:
        status = f"out of memory: {str(error).splitlines()[0]}"
        log(f"baseline {status}")
    seconds = median(times)
    result = {"status": status, "seconds_per_step": seconds, "step_seconds": times,
              "trainable_parameters": sum(p.numel() for p in trainable),
              "tokens_per_second": latent[1] * (latent[2] // 2) * (latent[3] // 2) * cfg.batch_size / seconds
              if seconds else None}
    if device.type == "cuda":
        result["memory"] = {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    del transformer, optimizer, trainable
    return result
