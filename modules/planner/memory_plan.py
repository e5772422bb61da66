"""Will it fit my card? The planner's entry points (DESIGN.md section 10), for the command line, the run plan at
train start and the GUI:

    predict(config) -> Prediction          # the run as configured
    fit(config, vram_gib) -> FitResult     # the fastest memory switches that fit, or the least memory (auto_fit.py)

Both trace the run's training step at its real width and shape on fake tensors (step_trace.py), composed from a
transformer cut to a few blocks (composed_trace.py; `exact`: the whole transformer): seconds, no weights, no GPU.
A fit plans up to a few dozen settings: it reports each trace (`progress`), stops
between traces when asked (`cancel`: PlanCancelled), and keeps its traces in the caller's `traces` memo, so a fit
of the same config to another card, or with the other objective, traces nothing again.
"""
from __future__ import annotations

import time

from modules.planner.auto_fit import (FitResult, Settings, block_weight_bytes, canonical, max_traces, settings_of,
                                      step_cost)
from modules.planner.auto_fit import fit as fit_settings
from modules.planner.plan_shapes import PlanError, PlanShape, largest_shape, resolve_architecture
from modules.planner.Prediction import GIB, PARTS, Prediction, allowance_bytes
from modules.util.config.TrainConfig import TrainConfig

__all__ = ["PlanError", "PlanCancelled", "Prediction", "FitResult", "Settings", "predict", "fit"]


class PlanCancelled(Exception):
    """A fit stopped on request, between two traces (not a PlanError: the search must not take it for a setting
    the run cannot use)."""


def predict(config: TrainConfig, shape: PlanShape | None = None, arch=None, detail: bool = False,
            exact: bool = False, progress=None, checked: bool = True) -> Prediction:
    """The run's predicted peak device memory for one training step at `shape` (default: the largest bucket);
    `arch`: a modules.benchmark Architecture instead of the one the config names; `detail`: the largest storages at
    the peak name the module they were made in (Prediction.peak_detail; a full trace). The plan is composed from
    traces of the transformer cut to a few blocks (composed_trace.py), or with `exact` (or where composing cannot
    be exact) traced whole. `progress(done, total, text)` after each trace. `checked` False: composed without the
    traces that check its lines (Prediction.checked; a fit's candidates)."""
    started = time.perf_counter()
    arch = arch or resolve_architecture(config)
    shape = shape or largest_shape(config, arch)
    how = "exact: the whole transformer traced (--exact)" if exact else "exact: the peak detail needs a full trace"
    if not (exact or detail):
        from modules.planner.composed_trace import compose
        composed, why = compose(config, arch, shape, progress=progress, checked=checked)
        if composed is not None:
            return _composed_prediction(config, arch, shape, composed, started)
        how = f"exact: the whole transformer traced ({why})"
    from modules.planner.step_trace import trace_step
    counter, facts = trace_step(config, arch, shape, detail=detail)
    if progress is not None:
        progress(1, 1, "the whole transformer")
    return Prediction(model=arch.name, shape=shape.text(), settings=settings_of(config).config_values(),
                      traced_bytes=counter.peak, parts=_parts(counter.breakdown()), peak_phase=counter.peak_phase,
                      host_pinned_bytes=counter.host_peak, parameters=facts["parameters"],
                      trainable_parameters=facts["trainable_parameters"], features=facts["features"],
                      seconds=time.perf_counter() - started, largest=counter.largest_at_peak(None if detail else 10),
                      preview_shape=facts["preview"][0].text() if "preview" in facts else None,
                      preview_bytes=facts["preview"][1] if "preview" in facts else 0, distill=facts.get("distill", ""),
                      how=how)


def _parts(tags: dict[str, int]) -> dict[str, int]:
    parts = {name: sum(tags.get(tag, 0) for tag in members) for name, members in PARTS.items()}
    known = {tag for members in PARTS.values() for tag in members}
    parts["transient"] += sum(v for tag, v in tags.items() if tag not in known)
    return parts


def _composed_prediction(config: TrainConfig, arch, shape: PlanShape, composed, started: float) -> Prediction:
    from modules.planner.composed_trace import features_text, phase_peak
    phase, peak, tags = phase_peak(composed)
    numbers = composed.numbers
    return Prediction(model=arch.name, shape=shape.text(), settings=settings_of(config).config_values(),
                      traced_bytes=peak, parts=_parts(tags), peak_phase=phase, host_pinned_bytes=numbers[("host",)],
                      parameters=numbers[("parameters",)], trainable_parameters=numbers[("trainable",)],
                      features=features_text(composed), seconds=time.perf_counter() - started,
                      preview_shape=composed.preview_shape.text() if composed.preview_shape else None,
                      preview_bytes=numbers.get(("preview",), 0), how=composed.how, distill=_distill_text(config),
                      checked=composed.checked)


def _distill_text(config: TrainConfig) -> str:
    if config.distill.mode != "preserve":
        return ""
    from modules.planner.preserve_plan import describe
    return describe(config)


def floor_bytes(config: TrainConfig, shape: PlanShape, arch, exact: bool = False) -> int:
    """A floor under predict(config, shape, arch).peak_bytes, from the step's start alone (the weights, adapters,
    optimizer state and inputs it holds before its forward pass; the allowance on top): a setting whose floor does
    not fit the card is passed over without tracing its step (a few times faster). Composed as predict is."""
    composed = None
    if not exact:
        from modules.planner.composed_trace import compose
        composed, _why = compose(config, arch, shape, setup_only=True)
    if composed is not None:
        start = composed.numbers[("start",)]
    else:
        from modules.planner.step_trace import trace_step
        start = trace_step(config, arch, shape, setup_only=True)[0].peak
    return start + allowance_bytes(start)


def fit(config: TrainConfig, vram_gib: float, log=lambda _text: None, known: Prediction | None = None,
        arch=None, shape: PlanShape | None = None, objective: str = "fastest", progress=None, cancel=None,
        traces: dict | None = None, ram_gib: float | None = None, exact: bool = False) -> FitResult:
    """The fastest checkpointing / block swap / offload settings whose predicted peak fits `vram_gib` (`objective`
    "least": the least memory); `known`: predict(config), when the caller has it; `arch` / `shape` as in predict.
    `progress(traced, at_most, text)` after each trace; `cancel()` true: PlanCancelled before the next trace;
    `traces`: the caller's memo of Settings -> Prediction for this config (its memory switches aside). `ram_gib`:
    only settings whose host plan (host_plan.py) fits that many GiB of host RAM too. `exact`: every setting traced
    whole (predict's `exact`). Composed plans share their cut traces: settings that differ only in the swapped
    blocks' count mostly trace nothing new. The candidates are composed without the traces that check their lines
    (two traces a line, not three: a fit traces about 40 % fewer blocks); the answer is composed again with them,
    and where a check fails the search runs again with every line checked, so the answer's prediction is always a
    checked one."""
    arch = arch or resolve_architecture(config)
    shape = shape or largest_shape(config, arch)
    layers = arch.transformer["num_layers"]
    cache: dict[Settings, Prediction] = traces if traces is not None else {}
    if known is not None:
        cache.setdefault(canonical(settings_of(config), layers), known)
    at_most = max_traces(layers) + 1   # the answer checked
    traced = [0]
    checked = [False]   # True once a check failed: every line checked from then on

    def predict_settings(settings: Settings) -> Prediction:
        settings = canonical(settings, layers)
        if settings not in cache or (checked[0] and not cache[settings].checked):
            if cancel is not None and cancel():
                raise PlanCancelled("cancelled")
            try:
                cache[settings] = predict(settings.apply(config), shape, arch, exact=exact, checked=checked[0])
            except PlanError as error:   # e.g. a fine-tune cannot swap the blocks it trains
                raise PlanError(f"{settings.text()}: {error}") from None
            traced[0] += 1
            text = f"{settings.text()}: {cache[settings].peak_gib:.1f} GiB predicted"
            log(f"  {text}")
            if progress is not None:
                progress(traced[0], at_most, text)
        return cache[settings]

    def checked_answer(result: FitResult) -> bool:
        """The answer's prediction composed again with its checking traces (its two others are kept): True when it
        holds (the result then carries the checked prediction)."""
        if result.settings is None or cache[canonical(result.settings, layers)].checked:
            return True
        key = canonical(result.settings, layers)
        candidate = cache[key]
        if cancel is not None and cancel():
            raise PlanCancelled("cancelled")
        prediction = predict(key.apply(config), shape, arch)
        if progress is not None:
            progress(traced[0] + 1, at_most, f"{key.text()}: checked")
        cache[key] = prediction
        if _same_numbers(prediction, candidate):
            result.prediction = prediction
            return True
        log(f"  {key.text()}: {prediction.peak_gib:.1f} GiB predicted with its lines checked, not "
            f"{candidate.peak_gib:.1f} GiB: every setting is predicted again, checked")
        checked[0] = True
        return False

    def floor_settings(settings: Settings) -> int | None:
        """The floor of a setting not traced yet (None when it is traced: its prediction decides)."""
        settings = canonical(settings, layers)
        if settings in cache:
            return None
        if cancel is not None and cancel():
            raise PlanCancelled("cancelled")
        try:
            floor = floor_bytes(settings.apply(config), shape, arch, exact)
        except PlanError as error:
            raise PlanError(f"{settings.text()}: {error}") from None
        if floor > vram_gib * GIB:
            log(f"  {settings.text()}: at least {floor / GIB:.1f} GiB before its step (the step not traced)")
        return floor

    from modules.planner.trace_pool import kept
    with kept():   # the trace workers stay for every setting: their dispatch caches stay warm
        first = predict_settings(settings_of(config))
        from modules.util.enum.DataType import DataType
        weight = config.model.transformer.weight_dtype
        bytes_per_weight = 1 if weight is DataType.FLOAT_8 else weight.torch_dtype().itemsize
        cost = step_cost(arch, shape, block_weight_bytes(first.parameters, layers, bytes_per_weight))
        host_fits = None
        if ram_gib is not None:
            from modules.planner.host_plan import plan_host

            def host_fits(settings: Settings, prediction: Prediction) -> str | None:
                host = plan_host(settings.apply(config), prediction, arch, shape)
                return None if host.fits(ram_gib) else (
                    f"its host RAM is {host.peak_gib:.1f} GiB predicted in phase {host.peak_phase} "
                    f"({host.largest_parts(host.peak_phase)})")
        def trace_blocks(settings: Settings) -> int:
            from modules.planner.composed_trace import traced_blocks
            return layers if exact else traced_blocks(settings.apply(config), arch, checked=checked[0])
        while True:
            known = {s: p for s, p in cache.items() if p.checked or not checked[0]}
            result = fit_settings(config, vram_gib, predict_settings, layers, cost, objective, floor_settings,
                                  host_fits, ram_gib, known=known, trace_blocks=trace_blocks)
            if checked_answer(result):
                return result


def _same_numbers(one: Prediction, other: Prediction) -> bool:
    fields = ("traced_bytes", "parts", "peak_phase", "host_pinned_bytes", "preview_bytes", "parameters",
              "trainable_parameters", "features")
    return all(getattr(one, name) == getattr(other, name) for name in fields)
