"""The text encoder released after caching and reloaded only for what still needs it.

Training reads every prompt's embeddings from the cache, so once the text pass of caching is done the text encoder
(UMT5-XXL: about 11 GiB in bfloat16) is dropped, before the VAE pass (`released_before_vae_pass`). A fine-tune's diffusers save needs it: `text_encoder_loaded` reads it again from the same
files, in the same dtype (the same numbers), for the length of the block, and drops it after.

Previews need only their prompts' embeddings: `prompts_ready` keeps them (`model.prompt_memo`, about 4 MiB a prompt
for UMT5-XXL), so the encoder is read again only when the samples file gains a prompt, not at every preview round.
Each is encoded alone on the sampling device, as the sampler would encode it, so a preview is the same either way.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable

import torch


def released_before_vae_pass(config) -> bool:
    """Whether a training run releases the text encoder right after its caching pass, before the VAE pass (the
    previews' prompts kept first), so UMT5 is not in host memory beside the clips the VAE pass decodes: not an
    embedding run (which trains it) nor distill.mode preserve (which encodes the empty caption after setup: it is
    released after that, as before). The host plan (host_plan.py) plans the caching passes on the same condition."""
    return config.training_method.value != "EMBEDDING" and config.distill.mode != "preserve"


def release_text_encoder(model, loader: Callable[[], torch.nn.Module]) -> None:
    """Drops `model`'s text encoder; `loader` reads it again when needed."""
    model.text_encoder_loader = loader
    model.text_encoder = None
    gc.collect()   # UMT5's modules hold reference cycles: freed now, not at some later collection


def prompts_remembered(model, prompts) -> bool:
    """Whether every prompt's embeddings are kept (WanModel.encode_text then needs no encoder)."""
    return all(prompt in model.prompt_memo for prompt in prompts)


def remember_prompts(model, prompts, device: torch.device | None = None) -> None:
    """Encodes and keeps the prompts not kept yet, each alone, with the encoder on `device` (put back after)."""
    missing = [prompt for prompt in dict.fromkeys(prompts) if prompt not in model.prompt_memo]
    if not missing:
        return
    with text_encoder_loaded(model), torch.no_grad():
        home = next(model.text_encoder.parameters()).device
        if device is not None:
            model.text_encoder.to(device)
        try:
            for prompt in missing:
                model.prompt_memo[prompt] = model.encode_text([prompt])[0].cpu()
        finally:
            model.text_encoder.to(home)


@contextmanager
def text_encoder_loaded(model):
    """`model.text_encoder` present inside the block: reloaded when it was released, released again after."""
    if model.text_encoder is not None or model.text_encoder_loader is None:
        yield
        return
    model.text_encoder = model.text_encoder_loader().requires_grad_(False).eval()
    try:
        yield
    finally:
        model.text_encoder = None
        gc.collect()
