"""`empty_weights()`: models built inside get their parameters on the meta device (no memory spent; buffers such as
the rope tables stay real), as `accelerate.init_empty_weights()` does, but in the calling thread only.

accelerate's context swaps `torch.nn.Module.register_parameter` for the whole process while it is entered, and puts
back what it found when it leaves. The window plans memory and reads model files in worker threads while the
training worker builds its model: a module built meanwhile got meta parameters, and two such contexts left in the
wrong order (the planner's and diffusers' own `from_pretrained`) left the meta version installed for good, so every
later Start failed with "Cannot copy out of meta tensor". Here the replacement is installed once, when this module is
imported (by the model loaders, on the main thread), and acts only while its own thread is inside the context.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_THREAD = threading.local()
_REGISTER_PARAMETER = torch.nn.Module.register_parameter


def _register_parameter(module: torch.nn.Module, name: str, param) -> None:
    _REGISTER_PARAMETER(module, name, param)
    if param is None or not getattr(_THREAD, "depth", 0):
        return
    registered = module._parameters[name]
    kwargs = dict(registered.__dict__)   # a subclass's own attributes (as accelerate keeps them)
    kwargs["requires_grad"] = param.requires_grad
    flag = kwargs.pop("_is_hf_initialized", None)
    module._parameters[name] = type(registered)(registered.to("meta"), **kwargs)
    if flag is not None:
        module._parameters[name]._is_hf_initialized = flag


if getattr(_REGISTER_PARAMETER, "__module__", "") != "torch.nn.modules.module":
    # imported while someone's process-wide patch was in place: wrapping it would keep it for good
    raise ImportError("modules.util.empty_weights must be imported while torch.nn.Module.register_parameter is "
                      "torch's own (import it before starting threads that build models)")
torch.nn.Module.register_parameter = _register_parameter


@contextmanager
def empty_weights():
    """Parameters of modules built in this thread go to the meta device; other threads are unaffected."""
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1
