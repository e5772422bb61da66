"""Gradient checkpointing for Wan2.2-Animate's face adapter. diffusers' `WanAnimateTransformer3DModel` runs its face
adapter blocks (one after every 5th transformer block) outside the checkpointed blocks, so each would keep several
full-size hidden states for the backward pass (measured by the planner at 14B, 77 x 544 x 736: 13 GiB of
activations on a 24 GB card): with checkpointing on, each adapter block is recomputed in the backward pass too."""
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_face_adapter(transformer: nn.Module) -> int:
    """Wraps each face adapter block's forward in torch's non-reentrant checkpoint; returns how many (0: none)."""
    adapters = getattr(transformer, "face_adapter", None)
    if adapters is None:
        return 0
    for adapter in adapters:
        if getattr(adapter, "_checkpointed", False):
            continue
        plain = adapter.forward
        adapter.forward = lambda *args, _plain=plain, **kwargs: checkpoint(_plain, *args, use_reentrant=False,
                                                                            **kwargs)
        adapter._checkpointed = True
    return len(adapters)
