"""Where each part of a model is while a sample is made. Its own module so that the samplers of each model family
share it without importing each other."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from modules.model.WanModel import WanModel
from modules.util.config.SampleConfig import SampleConfig


def _device_of(module: torch.nn.Module) -> torch.device | None:
    """The one device a module's tensors are on; None when they are spread over several (then it is left alone)."""
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    return devices.pop() if len(devices) == 1 else None


def _sharded(module: torch.nn.Module) -> bool:
    """An FSDP2 module (a sharded training run) gathers its blocks onto the device itself as each computes; moving
    it would break its shards (with CPU offload they live in host memory on purpose)."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


class Placement:
    """OneTrainer-style materialise / evict: a part away from the sampling device moves there only while used and
    goes back to where it was (its home) afterwards. Parts already on the sampling device never move."""

    def __init__(self, model: WanModel, device: torch.device):
        self.device = device
        self.parts = model.parts()
        self.home = {name: _device_of(part) for name, part in self.parts.items()}
        self.location = dict(self.home)

    def _movable(self, name: str) -> bool:
        return name in self.parts and self.home[name] is not None and self.home[name] != self.device \
            and not _sharded(self.parts[name])

    def _move(self, name: str, device: torch.device) -> None:
        self.parts[name].to(device)

    def materialize(self, *names: str) -> None:
        for name in names:
            if self._movable(name) and self.location[name] != self.device:
                self._move(name, self.device)
                self.location[name] = self.device

    def evict(self, *names: str) -> None:
        moved = False
        for name in names:
            if self._movable(name) and self.location[name] != self.home[name]:
                self._move(name, self.home[name])
                self.location[name] = self.home[name]
                moved = True
        if moved and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def encode_prompts(self, model: WanModel, sample: SampleConfig, use_cfg: bool):
        """(prompt, negative prompt or None) embeddings of a resolved sample, with the text encoder placed."""
        with self.using("text_encoder"):
            prompt = model.encode_text([sample.prompt]).to(self.device)
            negative = model.encode_text([sample.effective_negative_prompt]).to(self.device) if use_cfg else None
        return prompt, negative

    def restore(self) -> None:
        self.evict(*self.parts)

    @contextlib.contextmanager
    def using(self, *names: str) -> Iterator[None]:
        self.materialize(*names)
        try:
            yield
        finally:
            self.evict(*names)
