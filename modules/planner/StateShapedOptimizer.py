"""An optimizer that holds exactly the state tensors of an optimizer whose kernels cannot run on fake tensors, and
updates nothing: the planner's stand-in for bitsandbytes' 8-bit optimizers (CUDA kernels) and Prodigy (it reads
values back with `.item()`, which a fake tensor does not have).

The states, as their sources create them (facts, not code):
- bitsandbytes `Optimizer2State` / `Optimizer1State` (`bitsandbytes/optim/optimizer.py`, `init_state`): a parameter
  with at least `min_8bit_size` = 4096 elements gets uint8 states of its shape and one float32 absmax per block
  of 256 elements for each state; a smaller one gets float32 states. AdamW8bit has two states (exp_avg,
  exp_avg_sq), Lion8bit one. The kernels update in place: no per-step temporaries.
- prodigyopt `Prodigy.step`: exp_avg, exp_avg_sq, s and p0 of the parameter's shape, in its dtype.
"""
from __future__ import annotations

import math

import torch

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
STATES = {"ADAMW_8BIT": ("exp_avg", "exp_avg_sq"), "LION_8BIT": ("exp_avg",),
          "PRODIGY": ("exp_avg", "exp_avg_sq", "s", "p0")}


class StateShapedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, name: str):
        if name not in STATES:
            raise ValueError(f"no state layout known for optimizer {name!r}; one of {', '.join(STATES)}")
        self.name = name
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None or self.state[parameter]:
                    continue
                self.state[parameter] = self._states(parameter)
        return None

    def _states(self, parameter: torch.Tensor) -> dict[str, torch.Tensor]:
        state = {"step": torch.zeros((), dtype=torch.float32, device=parameter.device)}
        eight_bit = self.name != "PRODIGY" and parameter.numel() >= MIN_8BIT_SIZE
        for key in STATES[self.name]:
            if eight_bit:
                state[key] = torch.empty_like(parameter, dtype=torch.uint8)
                state[f"absmax_{key}"] = torch.empty(math.ceil(parameter.numel() / BLOCK_SIZE), dtype=torch.float32,
                                                     device=parameter.device)
            else:
                dtype = parameter.dtype if self.name == "PRODIGY" else torch.float32
                state[key] = torch.empty_like(parameter, dtype=dtype)
        return state
