"""Shared by the E2V "it learns" tests: the reference element's colour must decide the generated colour."""
import json
from pathlib import Path

import torch

from learning import train
from modules.model.e2v_condition import reference_latent_frames
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.SampleConfig import SampleConfig
from modules.util.demo_assets import COLOURS
from modules.util.demo_e2v import demo_e2v_config


def train_e2v(tmp_path: Path, t2v_base: Path, clip_source: Path, dataset: Path, e2v_type: str, steps: int,
              method: str = "FINE_TUNE", overrides=()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "e2v.json"
    config.write_text(json.dumps(demo_e2v_config(dataset)))
    return train(tmp_path, t2v_base, dataset, method, steps, [
        f"e2v.dataset_config={config}", f"e2v.e2v_type={e2v_type}", f"model.image_encoder.path={clip_source}",
        "data.frame_buckets=[17]", "data.concepts=[]", "optimizer.learning_rate=0.003",
        "optimizer.clip_grad_norm=null", "timestep.distribution=logit_normal", *overrides])


def colour_of(dataset: Path, stem: str) -> str:
    """The demo names no colour in captions; sample NNN's colour follows from its number (see demo_e2v)."""
    per_colour = len(list(dataset.glob("*.mp4"))) // len(COLOURS)
    return list(COLOURS)[int(stem) // per_colour]


@torch.no_grad()
def colour_accuracy(trainer, dataset: Path, seeds=(1001, 1002)) -> float:
    """Generates from one reference per colour and checks that the latent frames after the references are nearest
    to training videos of that colour."""
    model = trainer.model
    n_ref_latent = reference_latent_frames(trainer.data.e2v.num_reference_frames)
    videos: dict[str, list[torch.Tensor]] = {}
    items = trainer.data.target_latents_by_path()
    for path, latents in items.items():
        videos.setdefault(colour_of(dataset, Path(path).stem), []).append(
            model.normalize_latents(latents[None])[0][:, n_ref_latent:])
    for part in model.parts().values():
        part.eval()
    sampler = WanModelSampler(model, device=torch.device("cpu"), e2v_config=model.e2v_config)
    hits = total = 0
    for colour in COLOURS:
        stem = next(Path(p).stem for p in items if colour_of(dataset, Path(p).stem) == colour)
        for seed in seeds:
            sample = SampleConfig(prompt="a square moving left", width=32, height=32, frames=17, steps=20,
                                  guidance=1.0, seed=seed, elements={"main_subject": str(dataset / f"{stem}_person.png")})
            latents = sampler.sample(sample).latents[:, n_ref_latent:]
            nearest = min(videos, key=lambda c: min(torch.mean((latents - v) ** 2).item() for v in videos[c]))
            hits += nearest == colour
            total += 1
    return hits / total
