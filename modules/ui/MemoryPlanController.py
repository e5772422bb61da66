"""The training tab's memory plan: "fits 24 GiB: 19.8 GiB predicted; host RAM 17.2 GiB predicted (phase ...)" for
the config being edited, and "fit to my card" (the fastest memory switches that fit, or the least memory, written into the config). No toolkit here: the
view polls `poll()` from its main loop; planning (seconds to minutes, fake tensors) runs in a worker thread so the
window never blocks, reports each trace (`progress`) and stops between traces on `cancel()`.

Plans are kept by config hash: a prediction by the whole config (the line follows the card box with no new trace),
the traces of a fit by the config with its memory switches aside (a fit to another card size, or with the other
objective, traces nothing again), and each fit's answer by (config, card, objective) (asked again: instant).
"""
from __future__ import annotations

import hashlib
import json
import queue
import threading
import time

from modules.ui.UIState import UIState
from modules.util.config.config_io import ConfigError

OBJECTIVES = {"fastest that fits": "fastest", "least memory": "least"}
NOTHING_FITS_ADVICE = ("train smaller clips (data.frame_buckets, data.resolution), batch_size 1, a lower lora.rank, "
                       "or FLOAT_8 transformer weights (model.transformer.weight_dtype)")


def config_key(config, switches_aside: bool = False) -> str:
    """A hash of the config (with `switches_aside`, of the config with its memory switches at their defaults)."""
    if switches_aside:
        from modules.planner.auto_fit import Settings
        config = Settings(False).apply(config)
    text = json.dumps(config.model_dump(mode="json"), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class MemoryPlanController:
    def __init__(self, state: UIState):
        self.state = state
        self.text = "memory: not planned yet"
        self.details: list[str] = []     # what each switch of the last fit buys
        self.busy = False
        self.progress = (0, 0)           # traces made, at most, while a fit plans
        self.cancelled = False
        self._results: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self.closed = False
        self._started = 0.0
        self._predictions: dict[str, object] = {}        # config key -> Prediction
        self._hosts: dict[str, object] = {}              # config key -> HostPlan (host RAM per phase)
        self._traces: dict[str, dict] = {}               # config key, switches aside -> {Settings: Prediction}
        self._fits: dict[tuple, tuple] = {}              # (config key, card GiB, objective) -> fit's answer
        self._shown: tuple | None = None                 # (config key, on cpu) of the prediction the line shows
        self._fitted: tuple = (None, "")                 # (config key, line) of the config a fit set

    def predict(self, vram_gib: float | None) -> bool:
        """Starts a prediction of the current config (or answers from the plans kept); False when one is already
        running or the config is bad."""
        if self.busy:
            return False
        config = self._config()
        if config is None:
            return False
        key = config_key(config)
        if key not in self._predictions:   # traced by a fit already (its switches are one of those tried)?
            from modules.planner.auto_fit import settings_of
            traced = self._traces.get(config_key(config, switches_aside=True), {}).get(settings_of(config))
            if traced is not None:
                self._predictions[key] = traced
        if key in self._predictions:
            if key not in self._hosts:
                self._hosts[key] = _host_plan(config, self._predictions[key])
            self._shown = (key, _on_cpu(config))
            # the config a fit just set keeps the fit's line (what it chose and changed) until the card changes
            self.text = self._fitted[1] if key == self._fitted[0] else self.line(vram_gib)
            return True
        return self._start(lambda: self._predict(config, key, vram_gib))

    def card_changed(self, vram_gib: float | None) -> None:
        """The card box changed: the line says the kept prediction against the new size (no new trace)."""
        if self._shown is not None and not self.busy:
            self.text = self.line(vram_gib)

    def fit(self, vram_gib: float, objective: str = "fastest") -> bool:
        """Starts fitting the current config to `vram_gib` ("fastest": the fastest switches that fit, "least": the
        least memory); the chosen switches are set when poll() sees them. A fit asked before answers at once."""
        if self.busy:
            return False
        config = self._config()
        if config is None:
            return False
        key = (config_key(config), vram_gib, objective)
        if key in self._fits:
            self._results.put(("fit", self._fits[key] + (True,)))
            self.busy = True
            return True
        return self._start(lambda: self._fit(config, vram_gib, objective, key))

    def cancel(self) -> None:
        """Stops a fit before its next trace (the one running ends first)."""
        if self.busy:
            self._cancel.set()

    def status(self) -> str:
        """While a fit plans: its progress, for the label (the view polls it)."""
        done, at_most = self.progress
        seconds = time.monotonic() - self._started
        if self._cancel.is_set():
            return f"memory: cancelling after the current trace… ({seconds:.0f} s)"
        return f"memory: planning… trace {done + 1} of at most {at_most} ({seconds:.0f} s; cancel stops it)" \
            if at_most else f"memory: planning… ({seconds:.0f} s)"

    def poll(self) -> str | None:
        """From the main loop: the new text when a plan finished (fitted switches applied to the config)."""
        try:
            kind, payload = self._results.get_nowait()
        except queue.Empty:
            return None
        self.busy, self.progress = False, (0, 0)
        if kind == "fit":
            values, text, details, _kept = payload
            self.details = list(details)
            if values is not None:
                # said, not only done: the switches it changed (the fields elsewhere on the tab change with them)
                changed = [f"{path} = {value}" for path, value in values.items() if self.state.get(path) != value]
                for path, value in values.items():
                    self.state.set(path, value)
                text += f"; fit set {', '.join(changed)}" if changed else "; it fits as set, nothing changed"
                config = self._config()
                self._fitted = (config_key(config), text) if config is not None else (None, "")
            self.text = text
        elif kind == "prediction":
            key, on_cpu, vram_gib = payload
            self._shown = (key, on_cpu)
            self.text = self.line(vram_gib)
        else:
            self.text = payload
        return self.text

    def line(self, vram_gib: float | None) -> str:
        """The kept prediction against a card, with what to do when it does not fit."""
        key, on_cpu = self._shown
        prediction = self._predictions[key]
        text = prediction.summary(vram_gib)
        if vram_gib is not None and not prediction.fits(vram_gib):
            text += ': press "fit to my card" for the memory switches that fit'
        if on_cpu:
            text += " (a GPU figure: this run is set to train on the CPU, which uses no card memory)"
        host = self._hosts.get(key)
        return text + _host_text(host) if host is not None else text

    def close(self, timeout: float = 120) -> bool:
        """The window closes: a fit stops before its next trace, the trace or prediction running ends, and no new
        work starts. A worker still inside torch when the interpreter exits aborts the process ("terminate
        called", exit code 134), so the window waits for it. True when the worker has ended."""
        self.closed = True
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Tests: waits for the worker."""
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- worker ----------------------------------------------------------------------------------------------

    def _config(self):
        try:
            return self.state.config()
        except ConfigError as error:
            self.text = f"memory: fix the config first ({error.problems[0] if error.problems else error})"
            return None

    def _start(self, work) -> bool:
        if self.closed:
            return False
        self.busy, self.cancelled, self.progress = True, False, (0, 0)
        self._cancel.clear()
        self._started = time.monotonic()
        self.text = "memory: planning…"
        self._thread = threading.Thread(target=work, name="memory-plan", daemon=True)
        self._thread.start()
        return True

    def _report(self, done: int, at_most: int, _text: str) -> None:
        """The planner's progress (a fit's settings, a prediction's traces), from the worker (read by status() on
        the main loop)."""
        self.progress = (done, at_most)

    def _predict(self, config, key: str, vram_gib: float | None) -> None:
        from modules.planner.memory_plan import PlanError, predict
        try:
            gpus = _gpus(config)
            if gpus >= 2:
                self._results.put(("text", _per_gpu_line(config, gpus, vram_gib)))
                return
            self._predictions[key] = predict(config, progress=self._report)
            self._hosts[key] = _host_plan(config, self._predictions[key])
        except PlanError as error:
            self._results.put(("text", f"memory: not planned: {error}"))
            return
        self._results.put(("prediction", (key, _on_cpu(config), vram_gib)))

    def _fit(self, config, vram_gib: float, objective: str, key: tuple) -> None:
        from modules.planner.auto_fit import settings_of
        from modules.planner.memory_plan import PlanCancelled, PlanError, fit
        traces = self._traces.setdefault(config_key(config, switches_aside=True), {})
        try:
            result = fit(config, vram_gib, known=self._predictions.get(key[0]), objective=objective,
                         progress=self._report,
                         cancel=self._cancel.is_set, traces=traces)
        except PlanCancelled:
            self.cancelled = True
            self._results.put(("text", "memory: fit cancelled (the traces made so far are kept for the next one)"))
            return
        except PlanError as error:
            self._results.put(("fit", (None, f"memory: not planned: {error}", [], False)))
            return
        cpu = (" (GPU figures: this run is set to train on the CPU, which uses no card memory)"
               if _on_cpu(config) else "")
        if result.settings is None:
            answer = (None, f"{result.text()}{cpu}. To fit, {NOTHING_FITS_ADVICE}", [])
        else:
            configured = settings_of(config)
            known = self._predictions.get(key[0])
            goal = "least memory" if objective == "least" else "fastest that fits"
            host = _host_text(_host_plan(result.settings.apply(config), result.prediction))
            answer = (result.settings.config_values(), f"{result.prediction.summary(vram_gib)} ({goal}){cpu}{host}",
                      result.explain(configured, known.peak_gib if known is not None else None))
        self._fits[key] = answer
        self._results.put(("fit", answer + (False,)))


def _host_plan(config, prediction):
    """The run's host RAM per phase (modules/planner/host_plan.py) with the device plan of its step."""
    from modules.planner.host_plan import plan_host
    return plan_host(config, prediction, cuda=not _on_cpu(config))


def _host_text(host) -> str:
    """'; host RAM 17.2 GiB predicted (phase caching: VAE / image encoding)'"""
    return f"; host RAM {host.peak_gib:.1f} GiB predicted (phase {host.peak_phase})"


def _on_cpu(config) -> bool:
    from modules.util.devices import resolve_device
    try:
        return resolve_device(config.device).type == "cpu"
    except (ValueError, RuntimeError):
        return False


def _gpus(config) -> int:
    """The processes a `multi_gpu` run launches (distributed.processes, else one per visible GPU)."""
    if not config.multi_gpu:
        return 1
    import torch
    return config.distributed.processes or torch.cuda.device_count()


def _per_gpu_line(config, gpus: int, vram_gib: float | None) -> str:
    """'2 GPUs, sharded base: fits 16 GiB per GPU: 15.0 GiB predicted per GPU' (the layout the config asks for;
    shard_base auto: the one the run would take)."""
    from modules.planner.parallel_plan import configured, plan_layouts
    plan = configured(plan_layouts(config, gpus), config, vram_gib)
    if vram_gib is None:
        return f"{gpus} GPUs, {plan.layout}: {plan.peak_gib:.1f} GiB predicted per GPU"
    verdict = "fits" if plan.fits(vram_gib) else "does not fit"
    return f"{gpus} GPUs, {plan.layout}: {verdict} {vram_gib:g} GiB per GPU: {plan.peak_gib:.1f} GiB predicted per GPU"
