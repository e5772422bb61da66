"""The text encoder released after caching and reloaded only for what still needs it.

Training reads every prompt's embeddings from the cache, so after caching the text encoder (UMT5-XXL: about 11 GiB
in bfloat16) is dropped. Previews and a fine-tune's diffusers save need it: `text_encoder_loaded` reads it again
from the same files, in the same dtype (the same numbers), for the length of the block, and drops it after.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable

import torch


def release_text_encoder(model, loader: Callable[[], torch.nn.Module]) -> None:
    """Drops `model`'s text encoder; `loader` reads it again when needed."""
    model.text_encoder_loader = loader
    model.text_encoder = None
    gc.collect()   # UMT5's modules hold reference cycles: freed now, not at some later collection


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
