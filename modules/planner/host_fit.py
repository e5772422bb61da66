"""A run fitted to the host's RAM (`--ram-gib`, or the memory available at train start) beside the card's size:
which phase does not fit, with which parts, and the settings that would fit.

The memory switches the device fit searches (auto_fit.py) move host memory the other way: each swapped block and
each offloaded activation waits in host memory. So a device fit given `--ram-gib` takes the fastest switches that
fit both (FitResult.bound says which bound refused the others), and a run that does not fit the host is offered the
cuts that touch no switch the card needs, cumulatively, cheapest first (HOST_CUTS)."""
from __future__ import annotations

from dataclasses import dataclass, field

from modules.planner.host_plan import HostPlan, plan_host
from modules.util.config.TrainConfig import TrainConfig

# (config key, value, why it is cheap): applied one after another until the plan fits
HOST_CUTS = (("data.dataloader_threads", 1, "fewer decoded clips in flight while caching"),
             ("model.text_encoder.weight_dtype", "BFLOAT_16", "the text encoder is held in bfloat16"),
             ("model.transformer.weight_dtype", "FLOAT_8", "the transformer waits in host memory in float8"),
             ("performance.activation_offload", False, "the offloaded activations stay on the card"),
             ("performance.block_swap", 0, "the swapped blocks stay on the card"))


class RamDoesNotFit(ValueError):
    """The run is predicted not to fit the host's RAM."""


@dataclass
class HostFit:
    ram_gib: float
    plan: HostPlan                      # as configured
    values: dict | None                 # the cuts that fit (None: none does)
    fitted: HostPlan | None             # the plan with them (nothing fits: with every cut that lowers it)
    least_values: dict = field(default_factory=dict)   # nothing fits: those cuts

    def text(self) -> str:
        plan = self.plan
        if plan.fits(self.ram_gib):
            return f"host RAM: fits {self.ram_gib:g} GiB: {plan.peak_gib:.1f} GiB predicted (phase {plan.peak_phase})"
        lines = [f"host RAM: does not fit {self.ram_gib:g} GiB: {plan.peak_gib:.1f} GiB predicted in phase "
                 f"{plan.peak_phase} ({plan.largest_parts(plan.peak_phase)})"]
        if self.values is not None:
            lines.append(f"fits {self.ram_gib:g} GiB with " + ", ".join(f"{k}={v}" for k, v in self.values.items())
                         + f": {self.fitted.peak_gib:.1f} GiB predicted (phase {self.fitted.peak_phase})")
        else:
            least = self.fitted or plan
            cuts = ", ".join(f"{k}={v}" for k, v in self.least_values.items()) or "none applies"
            lines.append(f"nothing fits {self.ram_gib:g} GiB: the least is {least.peak_gib:.1f} GiB in phase "
                         f"{least.peak_phase} ({least.largest_parts(least.peak_phase)}), with every host cut that "
                         f"lowers it ({cuts})")
        return "\n".join(lines)


def apply_values(config: TrainConfig, values: dict) -> TrainConfig:
    """A copy of `config` with the dotted keys set (an enum field takes its value's name)."""
    config = config.model_copy(deep=True)
    for key, value in values.items():
        *path, name = key.split(".")
        owner = config
        for part in path:
            owner = getattr(owner, part)
        current = getattr(owner, name)
        setattr(owner, name, type(current)(value) if hasattr(current, "value") else value)
    return config


def fit_host(config: TrainConfig, ram_gib: float, prediction=None, cuda: bool | None = None,
             keep_switches: bool = False) -> HostFit:
    """The host plan as configured against `ram_gib`, and when it does not fit, the fewest HOST_CUTS (in order)
    that fit. `keep_switches`: only the cuts that leave the device's memory switches alone (the card needs them)."""
    plan = plan_host(config, prediction, cuda=cuda)
    if plan.fits(ram_gib):
        return HostFit(ram_gib, plan, {}, plan)
    values: dict = {}
    fitted = plan
    for key, value, _why in HOST_CUTS:
        if keep_switches and key.startswith("performance."):
            continue
        trying = {**values, key: value}
        # the device plan's pinned bytes belong to the switches as configured: a cut switch is planned without
        # them (it pins less)
        switches = any(k.startswith("performance.") for k in trying)
        planned = plan_host(apply_values(config, trying), None if switches else prediction, cuda=cuda)
        if planned.peak_bytes >= fitted.peak_bytes:
            continue   # lowers nothing here (e.g. the text encoder is in bfloat16 already)
        values, fitted = trying, planned
        if fitted.fits(ram_gib):
            return HostFit(ram_gib, plan, dict(values), fitted)
    return HostFit(ram_gib, plan, None, fitted, values)
