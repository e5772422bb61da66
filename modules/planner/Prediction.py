"""A planned run's predicted device memory, and how it is printed."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

GIB = 1024 ** 3

# What the card needs besides the tensors PyTorch allocates, added to every prediction (uncalibrated until a GPU
# run of `benchmark proof` measures it; docs/benchmarks.md): the CUDA context with PyTorch's kernels loaded
# (about 0.5 GiB on Hopper), cuBLAS / cuDNN workspaces (tens of MiB per stream) and the caching allocator's
# fragmentation (blocks reserved but not allocated), taken as 5 % of the traced peak.
CONTEXT_BYTES = 512 * 1024 ** 2
WORKSPACE_BYTES = 64 * 1024 ** 2
FRAGMENTATION = 0.05

# StorageCounter tags -> the four parts of the breakdown
PARTS = {"weights": ("weights",), "trainable + grads + optimizer": ("trainable", "grads", "optimizer_state", "ema"),
         "activations": ("activations", "inputs"), "transient": ("transient", "forward", "backward", "optimizer")}


def allowance_bytes(traced: int) -> int:
    return CONTEXT_BYTES + WORKSPACE_BYTES + int(FRAGMENTATION * traced)


@dataclass
class Prediction:
    model: str                  # the architecture's name (a released config or the base model's folder)
    shape: str                  # frames x height x width, batch
    settings: dict              # the memory switches the prediction is for
    traced_bytes: int           # the counted peak of live tensors
    parts: dict[str, int]       # PARTS name -> bytes at the peak
    peak_phase: str             # forward, backward or optimizer
    host_pinned_bytes: int      # block swap's weights and offloaded activations, at their peak
    parameters: int
    trainable_parameters: int
    features: str
    seconds: float
    largest: list = field(default_factory=list)   # (bytes, tag, op, module) of the largest storages at the peak
    preview_shape: str | None = None    # the largest sampling preview, when sampling.samples_file names some
    preview_bytes: int = 0              # live tensors during its forward pass, the training state included
    distill: str = ""                   # distill.mode preserve: what the step holds for it (the accelerator, teacher)
    how: str = ""                       # composed from cut traces, or traced whole (and why)
    checked: bool = True                # False: composed without the traces that check its lines (a fit's candidate)

    @property
    def counted_bytes(self) -> int:
        """The larger of the training step's peak and a preview's."""
        return max(self.traced_bytes, self.preview_bytes)

    @property
    def allowance_bytes(self) -> int:
        return allowance_bytes(self.counted_bytes)

    @property
    def peak_bytes(self) -> int:
        """What the card must have free: the counted peak plus the allowance."""
        return self.counted_bytes + self.allowance_bytes

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, vram_gib: float) -> bool:
        return self.peak_bytes <= vram_gib * GIB

    def summary(self, vram_gib: float | None = None) -> str:
        """One line for a label: 'fits 24 GiB: 19.8 GiB predicted'."""
        mode = f" ({self.distill})" if self.distill else ""
        if vram_gib is None:
            return f"{self.peak_gib:.1f} GiB predicted{mode}"
        verdict = "fits" if self.fits(vram_gib) else "does not fit"
        return f"{verdict} {vram_gib:g} GiB: {self.peak_gib:.1f} GiB predicted{mode}"

    def report(self) -> str:
        lines = [f"predicted peak: {self.peak_gib:.1f} GiB",
                 f"  model            {self.model}, {self.parameters / 1e9:.2f} B parameters, "
                 f"{self.trainable_parameters / 1e6:.1f} M trainable",
                 f"  shape            {self.shape} (the largest bucket the data can produce)",
                 f"  memory switches  {self.features}"]
        if self.distill:
            lines.append(f"  distill          {self.distill}")
        for name in PARTS:
            lines.append(f"  {name:<31}{self.parts.get(name, 0) / GIB:8.2f} GiB")
        lines.append(f"  {'allowance':<31}{self.allowance_bytes / GIB:8.2f} GiB (CUDA context, workspaces, "
                     f"fragmentation)")
        if self.preview_bytes > self.traced_bytes:
            lines.append("  peak held in     a sampling preview")
        else:
            lines.append(f"  peak held in     the {self.peak_phase} pass" if self.peak_phase != "optimizer"
                         else "  peak held in     the optimizer step")
        if self.preview_shape:
            lines.append(f"  previews         {self.preview_bytes / GIB:.2f} GiB at {self.preview_shape} (the training "
                         f"state plus one forward pass; the VAE decode is not planned)")
        lines.append(f"  host (pinned)    {self.host_pinned_bytes / GIB:.2f} GiB (block swap weights, offloaded "
                     f"activations)")
        lines.append(f"  planned in       {self.seconds:.1f} s on fake tensors (predicted on CPU, not measured)"
                     + (f"; {self.how}" if self.how else ""))
        return "\n".join(lines)

    def peak_detail(self, rows: int = 20) -> str:
        """The largest storages alive at the peak, with the op that made them and the module they were made in;
        storages that differ only in their block's index are one row ('blocks.N', with a count)."""
        groups: dict[tuple, int] = {}
        for nbytes, tag, op, module in self.largest:
            key = (nbytes, tag, op or "-", re.sub(r"blocks\.\d+\b", "blocks.N", module or "-"))
            groups[key] = groups.get(key, 0) + 1
        ordered = sorted(groups.items(), key=lambda item: item[0][0] * item[1], reverse=True)
        lines = ["largest storages at the peak (count x MiB; blocks.N: the same storage in several blocks):",
                 f"  {'count x MiB':>14}  {'part':<12} {'op':<36} module"]
        for (nbytes, tag, op, module), count in ordered[:rows]:
            lines.append(f"  {count:>4} x {nbytes / 1024 ** 2:7.1f}  {tag:<12} {op:<36} {module}")
        if len(ordered) > rows:
            rest = sum(key[0] * count for key, count in ordered[rows:])
            lines.append(f"  ... {len(ordered) - rows} smaller rows, {rest / 1024 ** 2:.1f} MiB in all")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(peak_bytes=self.peak_bytes, peak_gib=self.peak_gib, allowance_bytes=self.allowance_bytes)
        return data
