import threading
from typing import Any

import torch

from modules.dataLoader.DiskCache import DiskCache, cache_key
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.WanModel import TEXT_SEQUENCE_LENGTH


class EncodeText(PipelineModule):
    """UMT5 embeddings of the prompt, (512, D) with padding zeroed, cached on disk by (prompt, text encoder).
    Only the prompt's own tokens are stored; the zero padding is restored on load."""

    def __init__(self, model, cache: DiskCache, identity: str, name: str | None = None):
        super().__init__(name)
        self.model, self.cache, self.identity = model, cache, identity
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        return ["prompt"]

    def produces(self) -> list[str]:
        return ["text_embeds"]

    def key(self, prompt: str) -> str:
        return cache_key("text", prompt, self.identity)

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        return {"text_embeds": self._embeds(ctx.get("prompt", index))}

    def _embeds(self, prompt: str) -> torch.Tensor:
        """(512, D): the prompt's cached embeddings, zero padded."""
        key = self.key(prompt)
        cached = self.cache.get(key, required=["text_embeds"])
        if cached is None:
            with self.lock, torch.no_grad():
                self.encode_calls += 1
                embeds = self.model.encode_text([prompt])[0]
                length = int(self.model.tokenize([prompt])[1].sum())
            cached = {"text_embeds": embeds[:length].float().cpu()}
            self.cache.put(key, cached)
        embeds = cached["text_embeds"]
        padded = embeds.new_zeros(TEXT_SEQUENCE_LENGTH, embeds.shape[1])
        padded[:embeds.shape[0]] = embeds
        return padded
