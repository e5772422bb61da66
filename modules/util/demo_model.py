"""The demo's tiny model, made meaningful on first use so that its previews show something.

A tiny random VAE decodes every latent to noise, so a LoRA trained on it can never show what it learned. The demo
model is therefore the tiny Wan 2.1 T2V model of `tiny_models` with two parts made to know the demo's squares:

1. the VAE (diffusers' `AutoencoderKLWan`, the tiny config) gets weights that encode each 8 x 8 cell of a frame as
   its colour (modules/util/demo_vae.py), so it reconstructs the squares, a little blocky; its latent statistics
   are measured on the squares (`latents_mean` / `latents_std`, as the released configs hold the real VAE's);
2. the transformer is pre-trained on the squares with captions that name the colour but not the direction
   ("a red square"), with the flow-matching objective of training (`BaseWanSetup.predict`): the base draws a square
   of the prompt's colour, and the direction is left for the demo's LoRA to learn.

Known limit (measured): the base draws noisy 8 x 8 cells tinted the caption's colour, not a square where a clip
holds it. Its x0 prediction at s = 0.9 stays at the error of the captions' common mean (0.46-0.52, against 0.008 for
a per-caption mean) after 600, 1500 or 2000 steps, at learning rates 1e-3 to 5e-3, with the cross-attention's q/k
norms scaled 2-6x, with the text cut to its 8 real tokens (no padding keys), with the text path's weights scaled
5x, and even when pre-trained with the direction in the caption: the tiny transformer does not use the text for
position, so the demo's LoRA (200 steps) cannot show the direction either. Nor is it position alone: trained 600
steps on still squares captioned "a red square left" / "... right", its x0 error at s = 0.9 is 0.41, the error of
the common mean (0.40), against 0.20 for the colours' means and 0 for the captions'. The text barely reaches the
output at high noise (changing the caption moves the untrained transformer's output by 0.1 %), so the colours the
samples show come from the low-noise steps. Longer training is what starts to help: at 2500 steps (about 90 s on
one busy core) the still squares reach 0.15 and the moving squares with their full captions 0.35 (common mean 0.45),
so the text takes hold late and slowly; a recipe that gets there within the demo's first-use time is left to do.

Why (measured): Wan's transformer has no absolute position embedding (RoPE in self-attention is relative), and the
demo clip (9 x 32 x 32 -> latent 3 x 4 x 4) is only 3 x 2 x 2 tokens, so at high noise a token cannot tell where
in the frame or the clip it is, while each caption asks for nearly one fixed latent video. With a learned position
embedding added after the patch embedding (an experiment only: Wan has none), 1000 steps with the full captions
give 7 of 9 samples (3 captions x 3 seeds, 10 UniPC steps) that pass the preview check of tests/test_demo_model.py
(`caption_square_problems`: the caption's colour in every frame, moving its way); without it 0 of 9 after 2000
steps, 1 of 9 with 4 blocks, 0 of 9 with squares at random heights and start columns. A demo transformer with one
token per latent frame (patch 1 x 4 x 4, 4 heads of 64, feed-forward 1024), pre-trained 1200 steps with timesteps
drawn shifted towards noise (s = 3u / (1 + 2u)), does know where things are: its x0 error at s = 0.9 reaches the
colour captions' mean (0.185 against 0.178) and 6 of 9 of its samples show a square of the caption's colour
crossing the frame. But a 200-step rank-8 LoRA (lr 2e-3) on the directions leaves its samples as they were (6 of 16
pass, the direction is chance), and its steps cost 6 times the current ones (0.18 s against 0.03 s of CPU on a busy
core: the 512 padded text tokens through 256-wide cross-attention), so 1200 of them do not fit the first-use time.
One token for the whole clip (patch 3 x 4 x 4) draws the caption's colour (7 of 9 at width 64), but its loss stays
at 1.0 at widths 64 to 384 (a 768-value token cannot pass its noise through a narrower width; 768 wide, a step
costs over 20 times the current one), and a LoRA on the 64-wide one learns nothing (3 of 16 pass).

Deterministic for a seed on one machine; the folder is written atomically, like every tiny model.
"""
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from modules.util.atomic import atomic_dir
from modules.util.demo_squares import COLOURS, DIRECTIONS, demo_clip
from modules.util.demo_vae import set_cell_average_weights
from modules.util.portable_folder import make_portable
from modules.util.tiny_models import make_tiny_pipeline, part_seed

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
BASE_FILE = ROOT / "resources" / "demo" / "demo_base.safetensors"
# what scripts/make_demo_base.py trains the shipped base with; the file's metadata holds it, and a test holds the two
# equal, so a change here without regenerating the file is caught
BASE_CONFIG = {"variant": "wan2.1-t2v", "seed": 0, "steps": 3000, "learning_rate": 2e-3, "batch_size": 8,
               "timestep_shift": 3.0, "frames": 9, "size": 16, "captions": "colour"}
NUM_TRAIN_TIMESTEPS = 1000


def colour_caption(colour_name: str) -> str:
    """The base's caption: the colour only, so that the direction is what the demo's LoRA adds."""
    return f"a {colour_name} square"


def demo_videos() -> tuple[torch.Tensor, list[str]]:
    """The demo's squares (one clip per colour and direction, `demo_clip`) as (N, 3, F, H, W) in [-1, 1], with each
    clip's colour name."""
    clips, colours = [], []
    for colour_name, colour in COLOURS.items():
        for direction in DIRECTIONS:
            frames = torch.from_numpy(demo_clip(colour, direction, BASE_CONFIG["frames"]))
            # (F, H, W, 3) uint8 -> (3, F, H, W) in [-1, 1]
            clips.append(frames.permute(3, 0, 1, 2).float() / 127.5 - 1)
            colours.append(colour_name)
    return torch.stack(clips), colours


@torch.no_grad()
def set_latent_stats(vae, videos: torch.Tensor) -> torch.Tensor:
    """Measures the per-channel mean and std of the squares' latents into the VAE config; returns the raw latents."""
    latents = vae.encode(videos).latent_dist.mode()
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                           latents_std=[round(float(v), 4) for v in std])
    return latents


def shifted_sigmas(count: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Uniform draws moved towards noise by the flow shift (s u / (1 + (s - 1) u)), where the layout is decided."""
    u = torch.rand(count, generator=generator)
    return shift * u / (1 + (shift - 1) * u)


def pretrain_transformer(transformer, latents: torch.Tensor, text: torch.Tensor, config: dict = BASE_CONFIG) -> None:
    """Flow matching as in training (`BaseWanSetup.predict`): x_t = (1 - s) x0 + s noise, target noise - x0, the
    timestep s * 1000, the learning rate decayed linearly to 0. `latents` normalised (N, z, T, h, w); `text`
    (N, L, D) per clip."""
    steps, batch = config["steps"], config["batch_size"]
    generator = torch.Generator().manual_seed(part_seed(config["seed"], "demo_base_training"))
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=config["learning_rate"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    transformer.train()
    for _ in tqdm(range(steps), desc="demo base: learning the colours", unit="step"):
        index = torch.randint(0, len(latents), (batch,), generator=generator)
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        sigmas = shifted_sigmas(batch, config["timestep_shift"], generator)
        s = sigmas.view(-1, 1, 1, 1, 1)
        predicted = transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigmas * NUM_TRAIN_TIMESTEPS,
                                encoder_hidden_states=text[index], return_dict=False)[0]
        loss = ((predicted - (noise - x0)) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    transformer.eval().requires_grad_(False)


def _demo_parts(seed: int):
    """The tiny pipeline with its VAE set to the squares, and the squares' normalised latents and colour names."""
    from modules.model.WanModel import WanModel
    from modules.util.enum.WanVariant import WanVariant

    pipeline = make_tiny_pipeline(BASE_CONFIG["variant"], seed)
    model = WanModel(variant=WanVariant.T2V, tokenizer=pipeline.tokenizer, text_encoder=pipeline.text_encoder,
                     vae=pipeline.vae, transformer=pipeline.transformer)
    videos, colours = demo_videos()
    set_cell_average_weights(model.vae)
    latents = model.normalize_latents(set_latent_stats(model.vae, videos))
    return pipeline, model, latents, colours


def train_demo_base(seed: int = BASE_CONFIG["seed"]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Pre-trains the demo's base on the squares with colour-only captions (scripts/make_demo_base.py saves it):
    its float16 state dict, and the metadata the shipped file carries (this config, the VAE's latent statistics)."""
    pipeline, model, latents, colours = _demo_parts(seed)
    with torch.no_grad():
        text = model.encode_text([colour_caption(colour) for colour in colours])
    pretrain_transformer(model.transformer, latents, text, {**BASE_CONFIG, "seed": seed})
    weights = {name: value.detach().to(torch.float16).contiguous()
               for name, value in model.transformer.state_dict().items()}
    metadata = {"config": json.dumps({**BASE_CONFIG, "seed": seed}, sort_keys=True),
                "latents_mean": json.dumps(pipeline.vae.config.latents_mean),
                "latents_std": json.dumps(pipeline.vae.config.latents_std)}
    return weights, metadata


class DemoBaseError(RuntimeError):
    pass


def load_demo_base(transformer, vae, path: Path = BASE_FILE) -> None:
    """Loads the shipped base into the tiny transformer, after checking it was trained for this VAE's latents."""
    from safetensors import safe_open

    if not path.is_file():
        raise DemoBaseError(f"{path}: the demo's pre-trained base is missing; scripts/make_demo_base.py writes it")
    with safe_open(str(path), "pt") as file:
        metadata = file.metadata() or {}
        weights = {name: file.get_tensor(name) for name in file.keys()}
    for field in ("latents_mean", "latents_std"):
        shipped, measured = json.loads(metadata.get(field, "null") or "null"), list(vae.config[field])
        if shipped is None or len(shipped) != len(measured) or \
                max(abs(a - b) for a, b in zip(shipped, measured)) > 1e-3:
            raise DemoBaseError(f"{path}: {field} {shipped} was trained for other latents than this VAE's "
                                f"{measured}; regenerate it with scripts/make_demo_base.py")
    target = transformer.state_dict()
    if set(weights) != set(target) or any(weights[k].shape != target[k].shape for k in target):
        raise DemoBaseError(f"{path}: its tensors do not fit the tiny transformer; regenerate it with "
                            "scripts/make_demo_base.py")
    transformer.load_state_dict({name: value.to(target[name].dtype) for name, value in weights.items()})
    transformer.eval().requires_grad_(False)


def make_demo_pipeline(seed: int = 0):
    """The tiny Wan 2.1 T2V pipeline with its VAE set to the squares and the shipped base loaded (not saved)."""
    pipeline, _, _, _ = _demo_parts(seed)
    load_demo_base(pipeline.transformer, pipeline.vae)
    return pipeline


def make_demo_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Writes the demo's tiny model as a diffusers folder (replacing only an empty folder or a diffusers folder, as
    `make_tiny_model` does)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / "model_index.json").is_file():
        raise FileExistsError(f"{output_dir} exists, is not empty and holds no model_index.json; not replacing it")
    pipeline = make_demo_pipeline(seed)
    with atomic_dir(output_dir) as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True)
        make_portable(tmp)
    return output_dir
