"""Training-step benchmark: a full-size Wan transformer with random weights, random latents of the shape the VAE
would give and random 512-token text embeddings, trained for a few steps through the real code path
(`WanLoRASetup` / `WanFineTuneSetup`: `setup_model`, `predict`, `calculate_loss`; backward; gradient clipping and
`create_optimizer`'s AdamW step, as GenericTrainer does).

Reported: the median seconds per step after one warm-up step, peak memory (CUDA: max_memory_allocated; CPU: the
process's peak RSS) and FLOP utilisation: the analytic FLOPs of the step (`flops.count_flops`) divided by the step
time and by the device's peak rate (`--peak-tflops`; defaults: the datasheet bf16 peak of known GPUs, else a
measured matmul rate in the run's dtype).

Before any weight is allocated the run estimates its memory need (weights, gradients and AdamW state of what
trains, and activations, see `estimate_memory`) and stops with a "needs N GiB" message when that exceeds what the
device has (on CUDA: when the weights and optimizer state alone exceed it; a CUDA out-of-memory error during the
steps is caught and becomes the result's status), instead of being killed half-way.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from modules.benchmark.architectures import (TEXT_SEQUENCE_LENGTH, Architecture, build_empty_transformer,
                                                  get_architecture, make_wan_model, materialize, parameter_count)
from modules.benchmark.common import (GIB, available_memory_bytes, default_peak_tflops, environment,
                                           format_table, measure_matmul_tflops, median, peak_rss_bytes, rss_bytes,
                                           si, synchronize)
from modules.benchmark.flops import block_linears, count_flops, lora_pattern

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHT_DTYPES = ("fp32", "bf16", "fp8")   # fp8: float8_e4m3fn storage, bf16 compute (layerwise casting)


class InsufficientMemory(Exception):
    def __init__(self, message: str, estimate: dict):
        super().__init__(message)
        self.estimate = estimate


@dataclass
class TrainBenchConfig:
    variant: str = "wan2.1-1.3b"
    width: int = 832
    height: int = 480
    frames: int = 81
    steps: int = 3                      # timed steps, after one warm-up step
    dtype: str = "bf16"                 # compute dtype: fp32, or bf16 autocast
    weight_dtype: str | None = None     # frozen base weights (default: the compute dtype); a full fine-tune
                                        # holds the trained weights in fp32 whatever this says
    gradient_checkpointing: bool = False
    checkpoint_every: int = 1           # with checkpointing: every k-th block
    block_swap: int = 0                 # blocks whose frozen weights live on the host
    activation_offload: bool = False
    compile: bool = False               # regional torch.compile of the blocks
    attention: str = "auto"             # performance.attention
    recompute_norms: bool = True        # performance.recompute_norms
    chunk_tokens: int = 4096            # performance.chunk_tokens (0: off)
    memory_cap_gib: float | None = None  # CUDA: torch.cuda.set_per_process_memory_fraction
    baseline: bool = False              # also time a plain diffusers + peft step at the same shape
    optimizer: str = "ADAMW"            # OptimizerConfig.optimizer (the presets use ADAMW_8BIT)
    lora_rank: int | None = 32          # None: full fine-tune
    lora_targets: str = "attn-mlp"
    batch_size: int = 1
    device: str = "cpu"
    peak_tflops: float | None = None
    memory_check: bool = True
    seed: int = 0

    @property
    def full(self) -> bool:
        return self.lora_rank is None


# ------------------------------------------------------------------------------------------------ memory estimate

def lora_parameter_count(arch: Architecture, rank: int, targets: str) -> int:
    pattern = lora_pattern(targets)
    per_block = sum(rank * (i + o) for name, i, o, _ in block_linears(arch.dim, arch.transformer["ffn_dim"])
                    if pattern is not None and pattern.fullmatch(name))
    return per_block * arch.transformer["num_layers"]


# Activation elements kept for the backward pass per video token and block, in units of d (the width) and f (the
# FFN width); measured on CPU with the 1.3B architecture (docs/benchmarks.md), rounded up.
ACTIVATIONS_PER_TOKEN_D = 24
ACTIVATIONS_PER_TOKEN_F = 3
# What a CPU process holds besides the tensors (Python, torch, diffusers, allocator slack): measured 0.6 GiB.
CPU_RUNTIME_BYTES = 3 * GIB // 4


def estimate_memory(arch: Architecture, cfg: TrainBenchConfig, parameters: int) -> dict:
    """Rough bytes needed: weights, gradients + AdamW state of what trains, activations. An estimate for refusing
    runs that cannot fit, not a prediction."""
    weight_bytes = 4 if cfg.full else {"fp32": 4, "bf16": 2, "fp8": 1}[cfg.weight_dtype or cfg.dtype]
    trainable = parameters if cfg.full else lora_parameter_count(arch, cfg.lora_rank, cfg.lora_targets)
    # fp32 gradient + two fp32 AdamW moments (+ the fp32 weight itself for adapters)
    trainable_bytes = trainable * (12 if cfg.full else 16)
    _, frames, height, width = arch.latent_shape(cfg.frames, cfg.height, cfg.width)
    tokens = cfg.batch_size * frames * (height // 2) * (width // 2)
    act_bytes = 4 if cfg.dtype == "fp32" else 3   # bf16 activations, with fp32 norms and residuals mixed in
    d, f, layers = arch.dim, arch.transformer["ffn_dim"], arch.transformer["num_layers"]
    per_block = (tokens * (ACTIVATIONS_PER_TOKEN_D * d + ACTIVATIONS_PER_TOKEN_F * f)
                 + cfg.batch_size * TEXT_SEQUENCE_LENGTH * 4 * d) * act_bytes
    if cfg.gradient_checkpointing:
        activations = layers * tokens * d * 4 + per_block   # block inputs, plus one block being recomputed
    else:
        activations = layers * per_block
    runtime = CPU_RUNTIME_BYTES if cfg.device == "cpu" else 0
    weights = parameters * weight_bytes
    if cfg.block_swap:
        weights = weights * (layers - min(cfg.block_swap, layers - 1)) // layers
    if cfg.activation_offload and cfg.gradient_checkpointing:
        activations -= layers * tokens * d * 4 // cfg.checkpoint_every
    total = weights + trainable_bytes + activations + runtime
    return {"weights": weights, "trainable_state": trainable_bytes, "activations": activations,
            "runtime": runtime, "total": total, "parameters": parameters, "trainable_parameters": trainable}


# ------------------------------------------------------------------------------------------------ the benchmark

def _train_config(arch: Architecture, cfg: TrainBenchConfig):
    from modules.util.config.TrainConfig import TrainConfig
    from modules.util.enum.DataType import DataType
    from modules.util.enum.TrainingMethod import TrainingMethod

    values = dict(model_type=arch.variant.model_type, seed=cfg.seed, batch_size=cfg.batch_size,
                  train_dtype=DataType.FLOAT_32 if cfg.dtype == "fp32" else DataType.BFLOAT_16,
                  gradient_checkpointing=cfg.gradient_checkpointing, expert=arch.expert,
                  performance={"checkpoint_every": cfg.checkpoint_every, "block_swap": cfg.block_swap,
                               "activation_offload": cfg.activation_offload, "compile_blocks": cfg.compile,
                               "attention": cfg.attention, "recompute_norms": cfg.recompute_norms,
                               "chunk_tokens": cfg.chunk_tokens},
                  optimizer={"optimizer": cfg.optimizer},
                  training_method=TrainingMethod.FINE_TUNE if cfg.full else TrainingMethod.LORA)
    if not cfg.full:
        values["lora"] = {"rank": cfg.lora_rank, "alpha": float(cfg.lora_rank), "targets": cfg.lora_targets}
    return TrainConfig(**values)


def _setup_class(cfg: TrainBenchConfig):
    if cfg.full:
        from modules.modelSetup.WanFineTuneSetup import WanFineTuneSetup
        return WanFineTuneSetup
    from modules.modelSetup.WanLoRASetup import WanLoRASetup
    return WanLoRASetup


def run_train_benchmark(cfg: TrainBenchConfig, log=print) -> dict:
    """Runs the benchmark; returns the numbers (see the module doc). Raises InsufficientMemory before allocating
    anything when the estimate exceeds the device's memory (unless `memory_check` is off)."""
    if cfg.dtype not in DTYPES or (cfg.weight_dtype or cfg.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"--dtype is one of {', '.join(DTYPES)}; --weight-dtype one of {', '.join(WEIGHT_DTYPES)}")
    if cfg.steps < 1:
        raise ValueError("steps must be at least 1")
    device = torch.device(cfg.device)
    arch = get_architecture(cfg.variant)
    latent = arch.latent_shape(cfg.frames, cfg.height, cfg.width)
    compute_dtype = DTYPES[cfg.dtype]
    fp8 = not cfg.full and cfg.weight_dtype == "fp8"
    if fp8 and cfg.dtype != "bf16":
        raise ValueError("--weight-dtype fp8 computes in bf16: use --dtype bf16")
    weight_dtype = torch.float32 if cfg.full else DTYPES["bf16" if fp8 else cfg.weight_dtype or cfg.dtype]
    if cfg.memory_cap_gib is not None:
        if device.type != "cuda":
            raise ValueError("--memory-cap-gib caps CUDA memory (torch.cuda.set_per_process_memory_fraction); the "
                             f"device is {device.type}")
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gib * GIB / total), device)

    transformer = build_empty_transformer(arch)
    parameters = parameter_count(transformer)
    estimate = estimate_memory(arch, cfg, parameters)
    available = available_memory_bytes(device)
    if cfg.memory_cap_gib is not None:
        available = min(available, int(cfg.memory_cap_gib * GIB))
    result = {"variant": arch.name, "architecture": arch.description, "device": str(device),
              "shape": {"frames": cfg.frames, "height": cfg.height, "width": cfg.width,
                        "batch_size": cfg.batch_size},
              "latent_shape": list(latent), "config": asdict(cfg), "environment": environment(),
              "memory_estimate_gib": {k: (v / GIB if k not in ("parameters", "trainable_parameters") else v)
                                      for k, v in estimate.items()},
              "available_memory_gib": available / GIB}
    # CPU: the whole estimate must fit (running out there means the OOM killer). CUDA: only the certain part
    # (weights, gradients, AdamW state); an activation estimate is too rough to refuse on, and running out of
    # GPU memory is caught and reported as the run's status.
    needed = estimate["total"] if device.type == "cpu" else estimate["weights"] + estimate["trainable_state"]
    if cfg.memory_check and needed > available:
        raise InsufficientMemory(
            f"{arch.name} at {cfg.frames}x{cfg.height}x{cfg.width} ({'full' if cfg.full else f'LoRA r{cfg.lora_rank}'}"
            f", {cfg.dtype}{', checkpointing' if cfg.gradient_checkpointing else ''}) needs "
            f"{'about' if device.type == 'cpu' else 'at least'} {needed / GIB:.1f} GiB (weights "
            f"{estimate['weights'] / GIB:.1f}, gradients + AdamW {estimate['trainable_state'] / GIB:.1f}"
            + (f", activations ~{estimate['activations'] / GIB:.1f}, runtime {estimate['runtime'] / GIB:.2f}"
               if device.type == "cpu" else f", plus activations ~{estimate['activations'] / GIB:.1f}")
            + f"); {device.type} has {available / GIB:.1f} GiB available. Not run (--no-memory-check runs it "
            f"anyway).", result)

    peak, peak_source = ((cfg.peak_tflops, "--peak-tflops") if cfg.peak_tflops
                         else default_peak_tflops(device, compute_dtype))
    log(f"peak rate for utilisation: {peak:.3g} TFLOP/s ({peak_source})")

    started = time.perf_counter()
    # fp8 and block swap build the weights on the host: the device never holds the whole bf16 model
    materialize(transformer, weight_dtype, torch.device("cpu") if fp8 or cfg.block_swap else device, seed=cfg.seed)
    transformer.requires_grad_(False).eval()
    if fp8:
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model = make_wan_model(arch, transformer)
    config = _train_config(arch, cfg)
    setup = _setup_class(cfg)(config, model)
    setup.device = device
    setup.setup_model()
    setup.move_experts_to_device()
    performance = setup.performance["transformer"]
    log(f"memory and speed: {performance.describe()}")
    from modules.trainer.optimizers import create_optimizer
    trainable = setup.trainable_parameters()
    optimizer = create_optimizer(config.optimizer, trainable)
    build_seconds = time.perf_counter() - started
    log(f"built {arch.name}: {si(parameters, '')} parameters ({weight_dtype}), "
        f"{si(sum(p.numel() for p in trainable), '')} trainable, in {build_seconds:.1f} s")

    generator = torch.Generator().manual_seed(cfg.seed)
    batch = {"latents": torch.randn(cfg.batch_size, *latent, generator=generator),
             "text_embeds": torch.randn(cfg.batch_size, TEXT_SEQUENCE_LENGTH, arch.text_dim, generator=generator),
             "loss_weight": torch.ones(cfg.batch_size)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = rss_bytes()
    times, losses = [], []
    warmup = None
    status = "ok"
    try:
        for step in range(cfg.steps + 1):
            synchronize(device)
            start = time.perf_counter()
            step_generator = torch.Generator().manual_seed(cfg.seed * 1000 + step)
            prediction = setup.predict(batch, step_generator)
            loss = setup.calculate_loss(batch, prediction)
            loss.backward()
            if config.optimizer.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(trainable, config.optimizer.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            elapsed = time.perf_counter() - start
            losses.append(float(loss.detach()))
            del prediction, loss
            if step > 0:
                times.append(elapsed)
            else:
                warmup = elapsed   # includes compilation with --compile
            log(f"step {step}{' (warm-up)' if step == 0 else ''}: {elapsed:.2f} s, loss {losses[-1]:.4f}")
    except torch.OutOfMemoryError as error:
        status = f"out of memory at step {len(losses)}: {str(error).splitlines()[0]}"
        log(status)

    if device.type == "cuda":
        memory = {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                  "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    else:
        memory = {"peak_rss_gib": peak_rss_bytes() / GIB, "rss_before_steps_gib": rss_before / GIB}
    if peak_source.startswith("measured"):
        # a shared CPU's matmul rate varies with the other load: take the better of a reading before and after
        after = measure_matmul_tflops(device, compute_dtype)
        result["peak_tflops_readings"] = [peak, after]
        if after > peak:
            peak = after
        peak_source += ", the better of readings before and after the steps"
    layers = arch.transformer["num_layers"]
    recomputed = sum(performance.checkpointing.checkpointed(i) for i in range(layers)) \
        if performance.checkpointing is not None else 0
    flops = count_flops(arch.transformer, *latent[1:], batch_size=cfg.batch_size,
                        lora_rank=0 if cfg.full else cfg.lora_rank, lora_targets=cfg.lora_targets,
                        per_token_timesteps=arch.expand_timesteps, checkpointing=recomputed > 0,
                        recomputed_layers=recomputed)
    seconds = median(times)
    result.update({
        "status": status, "parameters": parameters,
        "trainable_parameters": sum(p.numel() for p in trainable), "weight_dtype": str(weight_dtype),
        "video_tokens": flops.video_tokens, "build_seconds": build_seconds,
        "step_seconds": times, "seconds_per_step": seconds, "losses": losses, "memory": memory,
        "flops": flops.as_dict(), "peak_tflops": peak, "peak_source": peak_source,
        "features": performance.describe(), "warmup_seconds": warmup,
        "tokens_per_second": flops.video_tokens * cfg.batch_size / seconds if seconds else None,
    })
    if seconds:
        result["model_tflops_per_second"] = flops.model / seconds / 1e12
        result["hardware_tflops_per_second"] = flops.hardware / seconds / 1e12
        result["mfu"] = flops.model / seconds / 1e12 / peak
        result["hfu"] = flops.hardware / seconds / 1e12 / peak
    if not all(math.isfinite(v) for v in losses):
        result["warning"] = "a loss was not finite"
    if cfg.baseline:
        from modules.benchmark.baseline_bench import run_baseline
        del setup, optimizer, trainable, transformer, model, performance
        if device.type == "cuda":
            torch.cuda.empty_cache()
        baseline = run_baseline(arch, cfg, device, torch.bfloat16 if fp8 else weight_dtype, log)
        result["baseline"] = baseline
        if seconds and baseline.get("seconds_per_step"):
            result["speedup_vs_baseline"] = baseline["seconds_per_step"] / seconds
            result["baseline"]["mfu"] = flops.model / baseline["seconds_per_step"] / 1e12 / peak
    return result


def train_table(result: dict) -> str:
    shape = result["shape"]
    cfg = result["config"]
    method = "full" if cfg["lora_rank"] is None else f"LoRA r{cfg['lora_rank']} ({cfg['lora_targets']})"
    memory = result.get("memory", {})
    memory_text = (f"{memory['peak_allocated_gib']:.2f} GiB allocated (CUDA peak)" if "peak_allocated_gib" in memory
                   else f"{memory.get('peak_rss_gib', 0):.2f} GiB RSS (process peak; "
                        f"{memory.get('rss_before_steps_gib', 0):.2f} before the steps)")
    flops = result["flops"]
    rows = [
        ["variant", f"{result['variant']} ({result['architecture']})"],
        ["device", f"{result['device']}  {result['environment'].get('gpu') or result['environment']['cpu']}"],
        ["shape", f"{shape['frames']}x{shape['height']}x{shape['width']} batch {shape['batch_size']} -> latents "
                  f"{'x'.join(map(str, result['latent_shape']))}, {result['video_tokens']} video tokens"],
        ["method", f"{method}, {cfg['dtype']}{' autocast' if cfg['dtype'] != 'fp32' else ''}, weights "
                   f"{result['weight_dtype'].removeprefix('torch.')}, checkpointing "
                   f"{'on' if cfg['gradient_checkpointing'] else 'off'}"],
        ["parameters", f"{si(result['parameters'], '')}, trainable {si(result['trainable_parameters'], '')}"],
        ["status", result["status"]],
        ["seconds / step", f"{result['seconds_per_step']:.3f} (median of {len(result['step_seconds'])} after 1 "
                           f"warm-up; min {min(result['step_seconds']):.3f}, max {max(result['step_seconds']):.3f})"
         if result.get("seconds_per_step") else "-"],
        ["peak memory", memory_text + (f", {memory['peak_reserved_gib']:.2f} GiB reserved"
                                       if "peak_reserved_gib" in memory else "")
         + (f" (cap {cfg['memory_cap_gib']} GiB)" if cfg.get("memory_cap_gib") else "")],
        ["FLOPs / step", f"{si(flops['model'], 'FLOP')} model (3 x forward), {si(flops['hardware'], 'FLOP')} "
                         f"with recompute"],
        ["achieved", f"{si(result['model_tflops_per_second'] * 1e12, 'FLOP/s')} model, "
                     f"{si(result['hardware_tflops_per_second'] * 1e12, 'FLOP/s')} hardware" if "mfu" in result
         else "-"],
        ["peak", f"{result['peak_tflops']:.3g} TFLOP/s ({result['peak_source']})"],
        ["MFU / HFU", f"{100 * result['mfu']:.2f} % / {100 * result['hfu']:.2f} %" if "mfu" in result else "-"],
        ["tokens / s", f"{result['tokens_per_second']:,.0f} video tokens per second"
         if result.get("tokens_per_second") else "-"],
        ["features", result.get("features", "-")],
    ]
    baseline = result.get("baseline")
    if baseline is not None:
        rows.append(["baseline", f"plain diffusers + peft: {baseline['status']}"
                     + (f", {baseline['seconds_per_step']:.3f} s / step, {baseline['tokens_per_second']:,.0f} "
                        f"tokens / s" if baseline.get("seconds_per_step") else "")
                     + (f", peak {baseline['memory']['peak_allocated_gib']:.2f} GiB" if "memory" in baseline else "")])
        if result.get("speedup_vs_baseline"):
            rows.append(["speed-up", f"{result['speedup_vs_baseline']:.2f} x the baseline's steps per second"])
    return format_table(["train benchmark", ""], rows)
