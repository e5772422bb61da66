"""Shared by the "it learns" tests: train a tiny model on the synthetic squares, then check that for each caption
the generated latents are closer to that caption's encoded videos than to the other captions'."""
import torch

from modules.modelLoader.wan.parts.model_plan import detect_model_variant
from modules.trainer.GenericTrainer import GenericTrainer
from modules.trainer.prepare import prepare_config
from modules.util.config.config_io import load_config


def train(tmp_path, base_model, dataset, method="LORA", steps=300, overrides=(), on_update=None):
    config = load_config(overrides=[
        f"model.base_model_name={base_model}", f"training_method={method}",
        f"workspace_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}",
        f"output.destination={tmp_path / 'out.safetensors'}", "output.dtype=FLOAT_32", "device=cpu",
        f"output.format={ {'LORA': 'COMFY_LORA', 'FINE_TUNE': 'ORIGINAL', 'EMBEDDING': 'SAFETENSORS'}[method]}",
        "train_dtype=FLOAT_32", "gradient_checkpointing=false", "epochs=1000", f"max_steps={steps}",
        "batch_size=4", f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]",
        "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0",
        "optimizer.weight_decay=0", "timestep.distribution=uniform", "tensorboard=false", *overrides])
    config.model_type = detect_model_variant(config.model).model_type
    trainer = GenericTrainer(config, on_update=on_update, e2v_datasets=prepare_config(config))
    trainer.train()
    return trainer


@torch.no_grad()
def class_latents(trainer) -> dict[str, torch.Tensor]:
    """caption -> normalised latents (N, C, T, h, w) of that caption's training videos, from the cache."""
    by_caption: dict[str, list] = {}
    data = trainer.data
    for batch in data.batches(0):
        for latents, prompt in zip(batch["latents"], batch["prompt"]):
            if not prompt:
                continue  # caption dropout
            by_caption.setdefault(prompt, []).append(trainer.model.normalize_latents(latents[None])[0])
    return {caption: torch.stack(items) for caption, items in by_caption.items()}


@torch.no_grad()
def generate(model, prompt: str, seed: int, steps: int = 20, guidance: float = 1.0) -> torch.Tensor:
    pipe = model.create_pipeline(image_mode=False)
    out = pipe(prompt=prompt, negative_prompt="", height=32, width=32, num_frames=9, num_inference_steps=steps,
               guidance_scale=guidance, output_type="latent", generator=torch.Generator().manual_seed(seed))
    return out.frames[0]


def nearest_class_accuracy(trainer, seeds=(1001, 1002), guidance: float = 1.0) -> float:
    """Share of (caption, held-out seed) generations whose nearest class mean is their own caption's."""
    classes = class_latents(trainer)
    # nearest member of each class, so clips of one caption that differ in position do not blur into a mean
    def distance(sample, caption):
        return min(torch.mean((sample - member) ** 2).item() for member in classes[caption])
    for part in trainer.model.parts().values():
        part.eval()
    hits = total = 0
    for caption in classes:
        for seed in seeds:
            sample = generate(trainer.model, caption, seed, guidance=guidance)
            nearest = min(classes, key=lambda c: distance(sample, c))
            hits += nearest == caption
            total += 1
    return hits / total


def assert_resumed_identically(full, first, resumed, steps: int) -> None:
    """A run of `steps` steps (`full`) and the same run stopped after its backup (`first`) then resumed from it
    (`resumed`): the same losses step for step and bit-identical trained weights."""
    assert resumed.progress.global_step == steps
    split = len(first.step_losses)
    assert first.step_losses == full.step_losses[:split]
    assert resumed.step_losses == full.step_losses[split:]
    final_full, final_resumed = full.setup.trainable_state_dict(), resumed.setup.trainable_state_dict()
    assert final_full.keys() == final_resumed.keys() and final_full
    for name in final_full:
        assert torch.equal(final_resumed[name], final_full[name]), name
