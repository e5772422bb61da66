"""The demo's accelerator: a 4-step LoRA distilled from the demo's base (scripts/make_demo_accelerator.py writes it
to resources/demo/demo_accelerator.safetensors), so that accelerated sampling can be seen working on the tiny world.

Method: rectified-flow reflow (Liu, Gong, Liu, "Flow Straight and Fast: Learning to Generate and Transfer Data with
Rectified Flow", ICLR 2023, arXiv:2209.03003, section 2.2; InstaFlow, arXiv:2309.06380, distils Stable Diffusion
this way) on the accelerator's own schedule. The teacher is the base with its ordinary sampler (40 UniPC steps,
guidance 1: the demo's base was trained without caption dropout, so it has no unconditional prediction to guide
against): for each caption and noise seed it gives the clean latent x0 its trajectory ends at. The student is the
base plus a LoRA, trained with the flow-matching loss on the straight line between the same noise and that x0,
`x_s = (1 - s) x0 + s noise`, target `noise - x0`, at the four sigmas LightX2V's step-distill scheduler samples
at (timesteps [1000, 750, 500, 250], shift 5: sigmas 1, 0.9375, 0.8333, 0.625; modules/modelSampler/accelerator.py).
A student that predicts that target exactly keeps the 4-step Euler sampler on the line, so its fourth step lands on
the teacher's x0. The noise seeds it trains on are not the ones it is measured at.

The file is in the layout of lightx2v's published Wan LoRAs (`diffusion_model.<official module>.lora_down.weight /
.lora_up.weight / .alpha`, bfloat16 factors), and its header records the schedule it was distilled for
(`wan_accelerator`, modules/util/accelerator_metadata.py) and the distillation settings (`demo_accelerator`).

The demo's base draws each caption's one clip already at 4 steps, so the accelerator is not needed there. Worlds
whose captions leave the colour or the direction open (`teacher_pairs` / `distil` given their captions) were built
to make the base blur at 4 steps where the accelerator would not; in none did the base fail at 4 steps while the
accelerator passed (measured in docs/distilled.md, "Worlds built to need the accelerator").
"""
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from modules.util.config.AcceleratorConfig import LIGHTX2V_SHIFT, LIGHTX2V_TIMESTEPS
from modules.util.demo_model import BASE_CONFIG, BASE_FILE, ROOT, base_caption
from modules.util.demo_squares import COLOURS, DEMO_SIZE, DIRECTIONS

ACCELERATOR_FILE = ROOT / "resources" / "demo" / "demo_accelerator.safetensors"
DISTILL_METADATA = "demo_accelerator"
DISTILL_CONFIG = {"seed": 0, "timesteps": LIGHTX2V_TIMESTEPS, "shift": LIGHTX2V_SHIFT, "teacher_steps": 40,
                  "teacher_guidance": 1.0, "noise_seeds_per_caption": 8, "first_noise_seed": 1000, "rank": 8,
                  "steps": 400, "batch_size": 8, "learning_rate": 2e-3}
# the measurement: every base caption at these seeds (none of them a training noise seed)
MEASURE_SEEDS = (0, 1, 2, 3)
FRAMES = BASE_CONFIG["frames"]


def demo_captions() -> list[tuple[str, str, str]]:
    """(base caption, colour, direction) of the 6 captions the base was trained on ("a red square moving east")."""
    return [(base_caption(colour, direction), colour, direction) for colour in COLOURS for direction in DIRECTIONS]


def load_folder(folder: str | Path):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def demo_sample(prompt: str, seed: int, steps: int = 4, guidance: float = 1.0):
    """A sample at the squares' size and length (the demo's previews')."""
    from modules.util.config.SampleConfig import SampleConfig
    return SampleConfig(prompt=prompt, width=DEMO_SIZE, height=DEMO_SIZE, frames=FRAMES, steps=steps,
                        guidance=guidance, seed=seed)


def _noise(model, seed: int) -> torch.Tensor:
    """The initial noise the sampler draws for `seed` (WanPipeline.prepare_latents): (z, T, h, w)."""
    from diffusers.utils.torch_utils import randn_tensor
    stride = model.vae_spatial_stride
    shape = (1, model.latent_channels, (FRAMES - 1) // 4 + 1, DEMO_SIZE // stride, DEMO_SIZE // stride)
    return randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)[0]


@torch.no_grad()
def teacher_pairs(model, config: dict = DISTILL_CONFIG,
                  captions: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's trajectories' ends: (noise (N, z, T, h, w), x0 (N, z, T, h, w), caption index (N,)), each
    noise seed's sample of each caption by the base's ordinary sampler: the scheduler, steps and guidance
    `WanModelSampler` resolves for the sample (`sample` runs the same), its denoising loop run on all N at once
    (tests/test_demo_accelerator.py holds one of them equal to `WanModelSampler.sample`'s latents)."""
    from modules.modelSampler.WanModelSampler import WanModelSampler
    captions = captions or [caption for caption, _, _ in demo_captions()]
    seeds = range(config["first_noise_seed"], config["first_noise_seed"] + config["noise_seeds_per_caption"])
    sampler = WanModelSampler(model, device="cpu")
    resolved, _ = sampler.resolve(demo_sample(captions[0], seeds[0], config["teacher_steps"],
                                                 config["teacher_guidance"]), log=False)
    if resolved.guidance > 1:
        raise ValueError("the demo base has no unconditional prediction (trained without caption dropout): "
                         "teacher_guidance must be 1")
    indices = torch.tensor([index for index in range(len(captions)) for _ in seeds])
    noises = torch.stack([_noise(model, seed) for _ in captions for seed in seeds])
    text = model.encode_text(captions)[indices]   # (N, L, D)
    scheduler = sampler.make_scheduler(resolved.scheduler, resolved.flow_shift)
    scheduler.set_timesteps(resolved.steps)
    latents = noises.clone()
    for t in tqdm(scheduler.timesteps, desc="demo accelerator: the base's samples", unit="step"):
        velocity = model.transformer(hidden_states=latents, timestep=t.expand(len(latents)),
                                     encoder_hidden_states=text, return_dict=False)[0]
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    return noises, latents, indices


def lora_targets(transformer) -> dict[str, torch.nn.Linear]:
    """The layers a lightx2v Wan LoRA touches: every block's self- and cross-attention projections and FFN."""
    return {name: module for name, module in transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and name.startswith("blocks.")
            and any(f".{part}." in name for part in ("attn1", "attn2", "ffn"))}


def distil(model, pairs, config: dict = DISTILL_CONFIG, captions: list[str] | None = None) -> dict[str, tuple]:
    """Trains the LoRA (reflow on the accelerator's sigmas, module docstring); {diffusers module name: (down (r, in),
    up (out, r))} in float32, alpha = rank."""
    from modules.modelSampler.accelerator import accelerator_sigmas
    noises, cleans, indices = pairs
    steps = config["steps"]
    transformer = model.transformer
    transformer.requires_grad_(False)
    generator = torch.Generator().manual_seed(config["seed"])
    rank = config["rank"]
    factors, handles = {}, []
    for name, layer in lora_targets(transformer).items():
        # the usual LoRA start: down random, up zero, so that step 0 is the base itself
        down = (torch.randn(rank, layer.in_features, generator=generator) / layer.in_features ** 0.5).requires_grad_()
        up = torch.zeros(layer.out_features, rank, requires_grad=True)
        factors[name] = (down, up)
        handles.append(layer.register_forward_hook(
            lambda module, args, output, d=down, u=up: output + F.linear(F.linear(args[0], d), u)))
    with torch.no_grad():
        text = model.encode_text(captions or [caption for caption, _, _ in demo_captions()])   # (C, L, D)
    sigmas = torch.tensor(accelerator_sigmas(config["timesteps"], config["shift"]))
    parameters = [tensor for pair in factors.values() for tensor in pair]
    optimizer = torch.optim.AdamW(parameters, lr=config["learning_rate"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / max(1, steps))
    batch = config["batch_size"]
    try:
        for _ in tqdm(range(steps), desc="demo accelerator: distilling", unit="step"):
            pick = torch.randint(0, len(noises), (batch,), generator=generator)
            sigma = sigmas[torch.randint(0, len(sigmas), (batch,), generator=generator)]
            s = sigma.view(-1, 1, 1, 1, 1)
            noise, x0 = noises[pick], cleans[pick]
            predicted = transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000,
                                    encoder_hidden_states=text[indices[pick]], return_dict=False)[0]
            loss = ((predicted - (noise - x0)) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (down.detach(), up.detach()) for name, (down, up) in factors.items()}


def accelerator_state_dict(factors: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """lightx2v's layout: `diffusion_model.<official module>.lora_down.weight / .lora_up.weight` (bfloat16) and
    `.alpha` (float32)."""
    from modules.util.lora.keys import diffusers_module_to_original
    state = {}
    for name, (down, up) in factors.items():
        stem = "diffusion_model." + diffusers_module_to_original(name)
        state[stem + ".lora_down.weight"] = down.to(torch.bfloat16).contiguous()
        state[stem + ".lora_up.weight"] = up.to(torch.bfloat16).contiguous()
        state[stem + ".alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)
    return state


def base_digest(path: Path = BASE_FILE) -> str:
    """sha256 of the shipped base's file: the header records which base the accelerator was distilled from."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def accelerator_header(config: dict = DISTILL_CONFIG, measured: dict | None = None) -> dict[str, str]:
    """The schedule it was distilled for (`wan_accelerator` naming no file: `own_schedule` reads it, and `sample
    --accelerator` runs it) and how it was made (`demo_accelerator`: the config, the base's digest, what it
    measured)."""
    from modules.util.accelerator_metadata import ACCELERATOR_METADATA
    schedule = dict(file="", file_2="", strength=1.0, steps=len(config["timesteps"]), timesteps=config["timesteps"],
                    shift=config["shift"])
    made = {"config": config, "base_sha256": base_digest(), **({"measured": measured} if measured else {})}
    return {ACCELERATOR_METADATA: json.dumps(schedule), DISTILL_METADATA: json.dumps(made, sort_keys=True)}


def square_passes(model, accelerator_path: str | Path | None, steps: int = 4, strength: float = 1.0,
                  seeds=MEASURE_SEEDS) -> dict[str, list[bool]]:
    """{caption: [passes `caption_square_problems` at each seed]} for the base captions: with the accelerator file
    (its schedule, 4 steps, guidance 1), or without one the base's ordinary sampler at `steps`, guidance 1."""
    from modules.modelSampler.accelerator import load_accelerator
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    from modules.util.square_check import caption_square_problems
    accelerator = None
    if accelerator_path is not None:
        accelerator = load_accelerator(model, AcceleratorConfig(file=str(accelerator_path), strength=strength))
    sampler = WanModelSampler(model, device="cpu", accelerator=accelerator)
    passes = {}
    for caption, colour, direction in demo_captions():
        passes[caption] = []
        for seed in seeds:
            clip = sampler.sample(demo_sample(caption, seed, steps)).frames_uint8()   # (F, H, W, 3)
            passes[caption].append(not caption_square_problems(clip, colour, direction))
    return passes


def lora_passes(model_folder: str | Path, lora_path: str | Path, accelerator_path: str | Path | None,
                steps: int = 4, strength: float = 1.0, seeds=MEASURE_SEEDS) -> dict[str, list[bool]]:
    """{caption: [passes `caption_square_problems` at each seed]} for the demo LoRA's 6 captions ("a red square
    moving left"), the LoRA merged into the demo model and sampled with the accelerator at `steps` steps and
    `strength` (without one: the ordinary sampler at `steps`), guidance 1."""
    from modules.modelSampler.accelerator import load_accelerator
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.config.AcceleratorConfig import AcceleratorConfig
    from modules.util.lora.apply import merge_lora
    from modules.util.lora.formats import load_lora_file, match_to_model
    from modules.util.square_check import caption_square_problems
    model = load_folder(model_folder)
    weights, _ = load_lora_file(lora_path)
    merge_lora(model.transformer, match_to_model(weights, {name for name, _ in model.transformer.named_modules()}))
    accelerator = None
    if accelerator_path is not None:
        accelerator = load_accelerator(model, AcceleratorConfig(file=str(accelerator_path), steps=steps,
                                                                strength=strength))
    sampler = WanModelSampler(model, device="cpu", accelerator=accelerator)
    passes = {}
    for colour in COLOURS:
        for direction in ("left", "right"):
            caption = f"a {colour} square moving {direction}"
            passes[caption] = [not caption_square_problems(sampler.sample(demo_sample(caption, seed, steps))
                                                           .frames_uint8(), colour, direction) for seed in seeds]
    return passes


def passed(passes: dict[str, list[bool]]) -> int:
    return sum(sum(row) for row in passes.values())


def make_demo_accelerator(output: Path = ACCELERATOR_FILE, config: dict = DISTILL_CONFIG, measure: bool = True,
                          log=print) -> dict:
    """Builds the demo model from the shipped base (a temporary folder), distils the accelerator and writes it
    atomically to `output`; with `measure`, measures it against the base and records the counts in its header:
    {"accelerated": passes, "base_4_steps": ..., "base_accelerator_schedule": ..., "base_40_steps": ...,
    "seconds": ...}."""
    import tempfile

    from modules.util.atomic import save_safetensors_atomic
    from modules.util.demo_model import make_demo_model
    started = time.monotonic()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = load_folder(make_demo_model(Path(tmp) / "tiny-wan2.1-t2v"))
        state = accelerator_state_dict(distil(model, teacher_pairs(model, config), config))
        output.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors_atomic(state, output, accelerator_header(config))
        if measure:
            report = {"accelerated": square_passes(model, output),
                      "base_4_steps": square_passes(model, None, 4),
                      "base_accelerator_schedule": square_passes(model, output, strength=0.0),
                      "base_40_steps": square_passes(model, None, config["teacher_steps"])}
            save_safetensors_atomic(state, output, accelerator_header(config, {key: passed(value) for key, value
                                                                              in report.items()}))
    for key, value in report.items():
        log(f"{key}: {passed(value)} of {sum(len(row) for row in value.values())}  "
            + "  ".join(f"{caption.removeprefix('a ')} {sum(row)}" for caption, row in value.items()))
    report["seconds"] = round(time.monotonic() - started, 1)
    log(f"{report['seconds']} s")
    return report
