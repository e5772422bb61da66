"""Fit a run to a card: the fastest combination of memory switches whose predicted peak fits (docs/benchmarks.md,
"Fitting a run to a card").

The switches and what each costs per step, in seconds on a nominal GPU (the order matters, not the seconds):
- gradient checkpointing every k blocks: each checkpointed block runs its forward pass again in the backward
  pass: (checkpointed blocks) x (one block's forward FLOPs) / COMPUTE_RATE.
- block swap N: each swapped block's frozen weights cross PCIe twice a step (forward, and the backward pass's
  recomputation); a copy overlaps the previous block's compute, so only what exceeds one block's compute time
  costs: N x 2 x max(0, copy - compute). Swapped blocks are always checkpointed: their recomputation is added.
- activation offload: each checkpointed block's input (tokens x width) goes to the host and back, overlapped the
  same way.
- attention inputs in chunks (`performance.chunk_attention_inputs`, with checkpointing every block): each
  checkpointed block computes its self-attention's q/k/v projections once more: (checkpointed blocks) x (their
  FLOPs) / COMPUTE_RATE.
Checkpointing costs FLOPs that no overlap hides, swaps and offloads cost only what their copies do not hide:
for a large shape a swap is nearly free and checkpointing is not; for a small one the reverse can hold.

The search: the combinations of checkpointing (off, every 2nd block, every block) and offload (with
checkpointing), cheapest first at no swap; for each, the fewest swapped blocks that fit (the prediction does not
grow with more swapped blocks), searched over real traces (`_fewest_swapped`: a guess from the peaks on both sides,
which fall nearly linearly, else bisection). Only swap counts that cost less than the best found are searched: a
combination whose cost without any swap already exceeds it is skipped, and one that does not fit with the most
swapped blocks still cheaper is left after that one trace. A setting whose step starts above the card (its
weights, adapters and optimizer state: `floor_settings`, a trace of the setup alone) is passed over without
tracing its step, and so is a setting where one with at least as much of every switch (`at_least`: at least its
swapped and checkpointed blocks, its offload, its attention inputs in chunks) did not fit: each switch only takes
memory off the device. Those combinations are traced first where their plans trace fewer blocks
(`rule_out_first`), so that one that does not fit leaves the others unpredicted. Each trace of a real-size model
takes seconds to minutes, so the traces saved are what a user waits for; the answer is the one a search of every
swap count gives. The objective "least" (least memory) takes
every switch at its most instead, the smallest peak the switches can give.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from modules.planner.plan_shapes import PlanError
from modules.util.config.TrainConfig import TrainConfig

COMPUTE_RATE = 400e12      # FLOP/s: an H100's dense bf16 peak (989 TFLOP/s) at about 40 % utilisation
TRANSFER_RATE = 20e9       # bytes/s: pinned host <-> device over PCIe 4.0 x16, as measured copies reach
TEXT_TOKENS = 512
GIB = 1024 ** 3
GUESSES = 2                # guessed swap counts (each traced with its neighbour) before the search bisects
OBJECTIVES = ("fastest", "least")   # the fastest settings that fit, or the least memory the switches can give


@dataclass(frozen=True)
class Settings:
    gradient_checkpointing: bool
    checkpoint_every: int = 1
    block_swap: int = 0
    activation_offload: bool = False
    attention_inputs: bool = False

    def apply(self, config: TrainConfig) -> TrainConfig:
        config = config.model_copy(deep=True)
        config.gradient_checkpointing = self.gradient_checkpointing
        config.performance.checkpoint_every = self.checkpoint_every
        config.performance.block_swap = self.block_swap
        config.performance.activation_offload = self.activation_offload and self.gradient_checkpointing
        config.performance.chunk_attention_inputs = self.attention_inputs and self.gradient_checkpointing
        return config

    def config_values(self) -> dict:
        """As --config-value / JSON fields."""
        return {"gradient_checkpointing": self.gradient_checkpointing,
                "performance.checkpoint_every": self.checkpoint_every, "performance.block_swap": self.block_swap,
                "performance.activation_offload": self.activation_offload,
                "performance.chunk_attention_inputs": self.attention_inputs}

    def text(self) -> str:
        parts = [f"checkpointing every {self.checkpoint_every}" if self.gradient_checkpointing
                 else "no checkpointing", f"block swap {self.block_swap}",
                 "activation offload" if self.activation_offload else "no offload"]
        if self.attention_inputs:
            parts.append("attention inputs in chunks")
        return ", ".join(parts)


def settings_of(config: TrainConfig) -> Settings:
    performance = config.performance
    return Settings(config.gradient_checkpointing, performance.checkpoint_every if config.gradient_checkpointing
                    else 1, performance.block_swap, performance.activation_offload and config.gradient_checkpointing,
                    performance.chunk_attention_inputs and config.gradient_checkpointing)


def combinations() -> list[Settings]:
    """The checkpointing / offload / attention-input combinations, at no swap (the last: every switch at its
    most)."""
    return [Settings(False), Settings(True, 2), Settings(True, 2, 0, True), Settings(True, 1),
            Settings(True, 1, 0, True), Settings(True, 1, 0, False, True), Settings(True, 1, 0, True, True)]


@dataclass
class StepCost:
    """Seconds a step spends on the switches (not the step's time)."""
    layers: int
    block_forward_seconds: float
    block_copy_seconds: float
    input_copy_seconds: float
    attention_inputs_seconds: float = 0.0   # one block's q/k/v projections

    def seconds(self, settings: Settings) -> float:
        checkpointed = set(range(self.layers - settings.block_swap, self.layers))
        if settings.gradient_checkpointing:
            checkpointed |= set(range(0, self.layers, settings.checkpoint_every))
        exposed = lambda copy: max(0.0, copy - self.block_forward_seconds)  # noqa: E731
        seconds = len(checkpointed) * self.block_forward_seconds
        seconds += settings.block_swap * 2 * exposed(self.block_copy_seconds)
        if settings.activation_offload:
            seconds += len(checkpointed) * 2 * exposed(self.input_copy_seconds)
        if settings.attention_inputs and settings.gradient_checkpointing:
            seconds += len(checkpointed) * self.attention_inputs_seconds
        return seconds


def step_cost(arch, shape, block_weight_bytes: int) -> StepCost:
    """The cost model's rates for this architecture and shape (see the module doc)."""
    c = arch.transformer
    d, f, layers = arch.dim, c["ffn_dim"], c["num_layers"]
    _z, frames, height, width = arch.latent_shape(shape.frames, shape.height, shape.width)
    tokens = frames * (height // c["patch_size"][1]) * (width // c["patch_size"][2])
    per_sample = (2 * tokens * (6 * d * d + 2 * d * f) + 2 * TEXT_TOKENS * 2 * d * d
                  + 4 * tokens * tokens * d + 4 * tokens * TEXT_TOKENS * d)
    block_flops = shape.batch_size * per_sample
    return StepCost(layers=layers, block_forward_seconds=block_flops / COMPUTE_RATE,
                    block_copy_seconds=block_weight_bytes / TRANSFER_RATE,
                    input_copy_seconds=shape.batch_size * tokens * d * 4 / TRANSFER_RATE,
                    attention_inputs_seconds=shape.batch_size * 2 * tokens * 3 * d * d / COMPUTE_RATE)


def max_traces(layers: int) -> int:
    """The most traces a search makes (as configured, every switch at its most, then per combination its no-swap,
    most-swap, guessed and bisection traces): a bound for a progress bar."""
    return 2 + len(combinations()) * (2 + 2 * GUESSES + math.ceil(math.log2(max(2, layers))))


@dataclass
class FitResult:
    vram_gib: float
    settings: Settings | None           # None: nothing fits
    prediction: object | None           # the chosen settings' Prediction
    cost_seconds: float | None
    tried: list[tuple[Settings, float]] = field(default_factory=list)   # (settings, predicted GiB), in order
    # (settings, GiB before the step) of settings whose step was not traced: they could not fit from its start
    passed_over: list[tuple[Settings, float]] = field(default_factory=list)
    # (settings, a setting with at least as much of every switch that did not fit): not traced (`at_least`)
    dominated: list[tuple[Settings, Settings]] = field(default_factory=list)
    cost: StepCost | None = None        # the cost model the choice was made with
    objective: str = "fastest"
    ram_gib: float | None = None        # the host's bound too (host_fit.py), when given
    # (settings, why) of settings that fit the card but not the host's RAM
    host_refused: list[tuple[Settings, str]] = field(default_factory=list)

    @property
    def bound(self) -> str:
        """Which bound decided: 'host RAM' when it refused settings faster than the choice (or every setting that
        fit the card), else 'device'."""
        if not self.host_refused:
            return "device"
        if self.settings is None or self.cost is None:
            return "host RAM"
        chosen = self.cost.seconds(self.settings)
        return "host RAM" if any(self.cost.seconds(s) < chosen for s, _ in self.host_refused) else "device"

    def explain(self, configured: Settings, configured_gib: float | None = None) -> list[str]:
        """What each chosen switch buys, added one at a time from no switch (memory from the traces made, time
        from the cost model), and the choice against the switches as `configured` (predicted `configured_gib`)."""
        if self.settings is None or self.cost is None:
            return []
        gib = {} if configured_gib is None else {configured: configured_gib}
        for settings, value in self.tried:
            gib.setdefault(settings, value)
        chosen = self.settings
        chain = [Settings(False)]
        if chosen.gradient_checkpointing:
            chain.append(Settings(True, chosen.checkpoint_every))
        if chosen.activation_offload:
            chain.append(Settings(True, chosen.checkpoint_every, 0, True))
        if chosen.attention_inputs:
            chain.append(Settings(True, chosen.checkpoint_every, 0, chosen.activation_offload, True))
        if chosen.block_swap:
            chain.append(chosen)
        lines = []
        for before, after in zip(chain, chain[1:]):
            if after.block_swap != before.block_swap:
                what = (f"block swap {after.block_swap}: {after.block_swap} blocks' frozen weights wait in host "
                        f"memory and are copied in for each pass")
            elif after.activation_offload != before.activation_offload:
                what = "activation offload: the checkpointed blocks' inputs wait in host memory"
            elif after.attention_inputs != before.attention_inputs:
                what = ("attention inputs in chunks: the self-attention's projections are recomputed chunk by "
                        "chunk, not kept")
            else:
                what = (f"checkpointing every {after.checkpoint_every}: those blocks' activations are recomputed "
                        f"in the backward pass, not kept")
            memory = (_memory_change(gib[after] - gib[before]) if before in gib and after in gib and
                      math.isfinite(gib[after] - gib[before]) else "memory not traced alone")
            lines.append(f"{what} ({memory}, {_time_change(self.cost.seconds(after) - self.cost.seconds(before))})")
        if configured != chosen and configured in gib and math.isfinite(gib[configured]):
            change = self.cost.seconds(chosen) - self.cost.seconds(configured)
            lines.append(f"against the switches as set ({gib[configured]:.1f} GiB predicted): "
                         f"{_memory_change(self.prediction.peak_gib - gib[configured])}, "
                         + (f"{_time_change(-change)[1:]} faster" if change < 0 else
                            f"{_time_change(change)[1:]} slower") + " on a nominal GPU")
        return lines

    def text(self) -> str:
        if self.settings is None:
            smallest = min(self.tried, key=lambda t: t[1]) if self.tried else None
            if self.host_refused:
                settings, why = self.host_refused[0]
                return (f"nothing fits both {self.vram_gib:g} GiB of device memory and {self.ram_gib:g} GiB of host "
                        f"RAM (bound: host RAM): {settings.text()} fits the card, but {why}")
            if smallest is None or smallest[1] == math.inf:
                return f"nothing fits {self.vram_gib:g} GiB"
            return (f"nothing fits {self.vram_gib:g} GiB: the least memory is {smallest[1]:.1f} GiB predicted "
                    f"({smallest[0].text()})")
        text = (f"fits {self.vram_gib:g} GiB with {self.settings.text()}: {self.prediction.peak_gib:.1f} GiB "
                f"predicted (switch cost ~{self.cost_seconds:.2f} s / step on a nominal GPU)")
        if self.ram_gib is not None:
            text += f"; fits {self.ram_gib:g} GiB of host RAM too (bound: {self.bound})"
        return text


def _memory_change(gib: float) -> str:
    return f"{gib:+.1f} GiB" if abs(gib) >= 0.1 else f"{gib * 1024:+.0f} MiB"


def _time_change(seconds: float) -> str:
    return f"{seconds:+.2f} s/step" if abs(seconds) >= 0.1 else f"{seconds * 1000:+.1f} ms/step"


def checkpointed_blocks(settings: Settings, layers: int) -> set[int]:
    """The blocks whose activations are recomputed: the swapped ones, and every k-th with checkpointing."""
    blocks = set(range(layers - settings.block_swap, layers))
    if settings.gradient_checkpointing:
        blocks |= set(range(0, layers, settings.checkpoint_every))
    return blocks


def at_least(more: Settings, less: Settings, layers: int) -> bool:
    """Whether `more` uses at least as much of every memory switch as `less` (at least its swapped blocks, its
    checkpointed blocks, its offload and its attention inputs in chunks): each switch only takes memory off the
    device (tests/test_memory_planner.py: more checkpointing and more swapped blocks never predict more), so
    `more` predicts no more than `less`, and when `more` does not fit neither does `less`."""
    more, less = canonical(more, layers), canonical(less, layers)
    return (more.block_swap >= less.block_swap and more.activation_offload >= less.activation_offload
            and more.attention_inputs >= less.attention_inputs
            and checkpointed_blocks(more, layers) >= checkpointed_blocks(less, layers))


def fit(config: TrainConfig, vram_gib: float, predict_settings, layers: int, cost: StepCost,
        objective: str = "fastest", floor_settings=None, host_fits=None, ram_gib: float | None = None,
        known: dict | None = None, trace_blocks=None) -> FitResult:
    """`predict_settings(settings) -> Prediction` (memoised by the caller); see the module doc for the search.
    `objective`: "fastest" (the fastest settings that fit) or "least" (the least memory). `floor_settings(settings)
    -> bytes | None`: a floor under the setting's predicted peak (cheaper than its prediction; None: none known); a
    setting whose floor exceeds the card is not predicted (FitResult.passed_over). `host_fits(settings, prediction)
    -> None | why`: the host's bound (`ram_gib`): a setting that fits the card but not the host is passed over
    (FitResult.host_refused); more swapped blocks only add host memory, so a combination is judged at its fewest.
    `known`: Settings -> Prediction the caller made before. A setting is not predicted where a setting with
    at least as much of every switch (`at_least`) did not fit (FitResult.dominated). `trace_blocks(settings) ->
    int`: how many blocks its prediction traces; given, a combination's no-swap setting is predicted after the
    combinations with more of every switch that trace fewer blocks (`rule_out_first`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    result = FitResult(vram_gib, None, None, None, cost=cost, objective=objective, ram_gib=ram_gib)

    def refused_by_host(settings: Settings, prediction) -> bool:
        why = host_fits(settings, prediction) if host_fits is not None else None
        if why is not None:
            result.host_refused.append((settings, why))
        return why is not None

    traced: dict[Settings, tuple[float, bool]] = {}   # canonical settings -> (predicted GiB, fits)
    for settings, prediction in (known or {}).items():
        traced[canonical(settings, layers)] = (prediction.peak_gib, prediction.fits(vram_gib))
    bounded: set[Settings] = set()   # canonical settings not predicted: a setting with more switches did not fit

    def dominated(settings: Settings) -> bool:
        key = canonical(settings, layers)
        if key in bounded:
            return True
        if key in traced:
            return False
        for other, (gib, fitting) in list(traced.items()):
            if not fitting and math.isfinite(gib) and other not in bounded and at_least(other, key, layers):
                result.dominated.append((settings, other))
                bounded.add(key)
                # its peak is above `gib`, by how much unknown: no anchor for a guessed swap count (_fewest_swapped
                # bisects), where the bound would guess too few swapped blocks and trace more settings
                traced[key] = (math.inf, False)
                return True
        return False

    def fits(settings: Settings, floored: bool = True):
        if floored and dominated(settings):
            return None
        try:
            floor = floor_settings(settings) if floored and floor_settings is not None else None
            if floor is not None and floor > vram_gib * GIB:
                result.passed_over.append((settings, floor / GIB))
                traced[canonical(settings, layers)] = (floor / GIB, False)
                return None
            prediction = predict_settings(settings)
        except PlanError:   # a setting this run cannot use (a fine-tune cannot swap the blocks it trains)
            result.tried.append((settings, math.inf))
            traced[canonical(settings, layers)] = (math.inf, False)
            return None
        result.tried.append((settings, prediction.peak_gib))
        traced[canonical(settings, layers)] = (prediction.peak_gib, prediction.fits(vram_gib))
        return prediction if prediction.fits(vram_gib) else None

    max_swap = layers
    frugal = _with_swap(combinations()[-1], max_swap)
    least = fits(frugal, floored=False)
    if least is None and result.tried[-1][1] != math.inf:   # not even every switch at its most: nothing does
        return result
    if objective == "least":
        if least is not None and not refused_by_host(frugal, least):
            result.settings, result.prediction, result.cost_seconds = frugal, least, cost.seconds(frugal)
            # each switch's share of the saving, for explain(): the switches added one at a time
            for step in (Settings(False), Settings(True, 1), Settings(True, 1, 0, True),
                         Settings(True, 1, 0, True, True)):
                fits(step, floored=False)
        return result
    def key(settings: Settings):   # equal cost: fewer swapped blocks, then no offload, then no attention chunks
        return cost.seconds(settings), settings.block_swap, settings.activation_offload, settings.attention_inputs

    def rule_out_first(base: Settings) -> None:
        """Before `base` (no swap) is traced, the combinations with at least as much of every switch whose traces
        are cheaper (`trace_blocks`), fewest switches first: one that does not fit leaves `base` unpredicted."""
        if trace_blocks is None or canonical(base, layers) in traced or dominated(base):
            return
        for other in combinations():
            if (other != base and canonical(other, layers) not in traced and at_least(other, base, layers)
                    and trace_blocks(other) < trace_blocks(base)):
                fits(other)
                if dominated(base):
                    return

    for base in sorted(combinations(), key=key):
        # only swap counts that cost less than the best found can change the answer (the key grows with the count)
        cap = max_swap if result.settings is None else \
            max((n for n in range(max_swap + 1) if key(_with_swap(base, n)) < key(result.settings)), default=-1)
        if cap < 0:
            continue
        rule_out_first(base)
        prediction = fits(base)
        if prediction is None:
            high = _fewest_swapped(base, cap, vram_gib, traced, fits, layers)
            if high is None:
                continue
            base = _with_swap(base, high)
            prediction = predict_settings(base)
        if refused_by_host(base, prediction):
            continue
        if result.settings is None or key(base) < key(result.settings):
            result.settings, result.prediction, result.cost_seconds = base, prediction, cost.seconds(base)
    return result


def _fewest_swapped(base: Settings, cap: int, vram_gib: float, traced: dict, fits, layers: int) -> int | None:
    """The fewest swapped blocks (1..cap) with which `base` fits, or None; `base` itself (no swap) does not fit.
    `traced`: canonical settings -> (predicted GiB, fits) of the traces made. More swapped blocks never predict
    more, so the answer is where the peaks cross the card's size: the search guesses it where the line through the
    peaks on both sides crosses it (they fall nearly linearly: each swapped block takes its weights and, unless
    checkpointed already, its kept activations off the device), traces the guess and its neighbour on the other
    side, and after GUESSES such pairs bisects; as a bisection, it ends with both sides of the answer traced."""
    if cap == 0:
        return None
    everything = traced.get(canonical(_with_swap(base, layers), layers))
    if everything is not None and not everything[1]:
        return None   # not even every block swapped fits
    # a count above `cap` traced and fitting is the search's upper end: `cap` itself is then traced only where the
    # line through the peaks guesses it (an answer above `cap` costs more than the best found: no answer)
    high = next((count for count in range(cap, layers + 1)
                 if traced.get(canonical(_with_swap(base, count), layers), (0, False))[1]), None)
    if high is None:
        if fits(_with_swap(base, cap)) is None:
            return None
        high = cap
    low = 0   # low does not fit, high does

    def probe(count: int) -> None:
        nonlocal low, high
        if fits(_with_swap(base, count)) is not None:
            high = count
        else:
            low = count

    for _ in range(GUESSES):
        peak_low = traced[canonical(_with_swap(base, low), layers)][0]
        peak_high = traced[canonical(_with_swap(base, high), layers)][0]
        if high - low <= 1 or low >= cap:
            break
        if math.isfinite(peak_low) and peak_low > peak_high:
            guess = low + math.ceil((peak_low - vram_gib) / (peak_low - peak_high) * (high - low) - 1e-9)
        else:
            # no peak below (`base` left unpredicted, `dominated`, or not usable): the line through `high` and the
            # count above it, when traced (each swapped block takes off about as much as the one before); else
            # the count just below `high`, which ends the search when it does not fit
            above = traced.get(canonical(_with_swap(base, high + 1), layers)) if high < layers else None
            if above is not None and math.isfinite(above[0]) and above[0] < peak_high:
                guess = high - math.floor((vram_gib - peak_high) / (peak_high - above[0]) + 1e-9)
            else:
                guess = high - 1
        guess = min(high - 1, max(low + 1, guess), cap)
        probe(guess)
        neighbour = guess - 1 if high == guess else guess + 1   # a right guess ends the search
        if low < neighbour < high and neighbour <= cap:
            probe(neighbour)
    while high - low > 1 and low < cap:
        probe(min((low + high) // 2, cap))
    return high if high <= cap else None


def _with_swap(settings: Settings, count: int) -> Settings:
    return Settings(settings.gradient_checkpointing, settings.checkpoint_every, count, settings.activation_offload,
                    settings.attention_inputs)


def canonical(settings: Settings, layers: int) -> Settings:
    """Settings that run alike share one trace: with every block swapped every block is checkpointed anyway."""
    if settings.block_swap >= layers:
        return Settings(True, 1, layers, settings.activation_offload, settings.attention_inputs)
    return settings


def block_weight_bytes(parameters: int, layers: int, bytes_per_weight: float) -> int:
    """One block's share of the weights (the blocks hold nearly all of them)."""
    return math.ceil(parameters / layers * bytes_per_weight)
