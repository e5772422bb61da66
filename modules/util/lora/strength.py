"""A trained peft adapter at another strength, for previews (sampling.compare_strengths): every adapter layer's
scaling multiplied by the strength while the context lasts and put back exactly after. Strength s gives the same
weight delta as merging the saved LoRA file at strength s."""
import contextlib
from collections.abc import Iterator

import torch
from peft.tuners.tuners_utils import BaseTunerLayer


@contextlib.contextmanager
def adapter_strength(modules: list[torch.nn.Module], strength: float) -> Iterator[None]:
    saved = []
    for root in modules:
        for layer in root.modules():
            scaling = getattr(layer, "scaling", None)
            if isinstance(layer, BaseTunerLayer) and isinstance(scaling, dict):
                saved.append((scaling, dict(scaling)))
                for name in scaling:
                    scaling[name] = scaling[name] * strength
    try:
        yield
    finally:
        for scaling, values in saved:
            scaling.update(values)
