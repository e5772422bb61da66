"""What sampling between optimizer steps must leave as it found: modes, requires_grad, peft adapter flags, RNGs."""
import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from modules.model.WanModel import WanModel


def _adapter_layers(module: torch.nn.Module) -> list:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def preserved_state(model: WanModel, device: torch.device) -> Iterator[None]:
    """Everything sampling may touch comes back exactly as it was: train/eval mode of every module, requires_grad of
    every parameter, peft adapters' enabled flags, and the torch (CPU and `device`), numpy and Python RNGs.
    Inside, every part is in eval mode and every peft adapter layer is enabled."""
    parts = list(model.parts().values())
    modes = [(m, m.training) for part in parts for m in part.modules()]
    grads = [(p, p.requires_grad) for part in parts for p in part.parameters()]
    adapters = [(layer, layer.disable_adapters) for part in parts for layer in _adapter_layers(part)]
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            for part in parts:
                part.eval()
            for layer, disabled in adapters:
                if disabled:
                    layer.enable_adapters(True)
            with torch.no_grad():
                yield
    finally:
        for layer, disabled in adapters:
            if layer.disable_adapters != disabled:
                layer.enable_adapters(not disabled)
        for module, training in modes:
            module.training = training
        for parameter, requires_grad in grads:
            if parameter.requires_grad != requires_grad:
                parameter.requires_grad_(requires_grad)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
