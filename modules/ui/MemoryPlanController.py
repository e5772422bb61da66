"""The training tab's memory plan: "fits 24 GiB: 19.8 GiB predicted" for the config being edited, and "fit to my
card" (the fastest memory switches that fit, written into the config). No toolkit here: the view polls `poll()`
from its main loop; planning (seconds, fake tensors) runs in a worker thread so the window never blocks."""
from __future__ import annotations

import queue
import threading

from modules.ui.UIState import UIState
from modules.util.config.config_io import ConfigError


class MemoryPlanController:
    def __init__(self, state: UIState):
        self.state = state
        self.text = "memory: not planned yet"
        self.busy = False
        self._results: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def predict(self, vram_gib: float | None) -> bool:
        """Starts a prediction of the current config; False when one is already running or the config is bad."""
        return self._start(lambda config: self._predict(config, vram_gib))

    def fit(self, vram_gib: float) -> bool:
        """Starts fitting the current config to `vram_gib`; the chosen switches are set when poll() sees them."""
        return self._start(lambda config: self._fit(config, vram_gib))

    def poll(self) -> str | None:
        """From the main loop: the new text when a plan finished (fitted switches applied to the config)."""
        try:
            kind, payload = self._results.get_nowait()
        except queue.Empty:
            return None
        self.busy = False
        if kind == "fit" and payload[0] is not None:
            # said, not only done: the switches it changed (the fields elsewhere on the tab change with them)
            changed = [f"{path} = {value}" for path, value in payload[0].items() if self.state.get(path) != value]
            for path, value in payload[0].items():
                self.state.set(path, value)
            self.text = payload[1] + (f"; fit set {', '.join(changed)}" if changed else
                                      "; it fits as set, nothing changed")
        else:
            self.text = payload if kind != "fit" else payload[1]
        return self.text

    def wait(self, timeout: float | None = None) -> None:
        """Tests: waits for the worker."""
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- worker ----------------------------------------------------------------------------------------------

    def _start(self, work) -> bool:
        if self.busy:
            return False
        try:
            config = self.state.config()
        except ConfigError as error:
            self.text = f"memory: fix the config first ({error.problems[0] if error.problems else error})"
            return False
        self.busy = True
        self.text = "memory: planning..."
        self._thread = threading.Thread(target=work, args=(config,), name="memory-plan", daemon=True)
        self._thread.start()
        return True

    def _predict(self, config, vram_gib: float | None) -> None:
        from modules.planner.memory_plan import PlanError, predict
        try:
            gpus = _gpus(config)
            self._results.put(("text", predict(config).summary(vram_gib) if gpus < 2
                               else _per_gpu_line(config, gpus, vram_gib)))
        except PlanError as error:
            self._results.put(("text", f"memory: not planned: {error}"))

    def _fit(self, config, vram_gib: float) -> None:
        from modules.planner.memory_plan import PlanError, fit
        try:
            result = fit(config, vram_gib)
        except PlanError as error:
            self._results.put(("fit", (None, f"memory: not planned: {error}")))
            return
        if result.settings is None:
            self._results.put(("fit", (None, result.text())))
            return
        self._results.put(("fit", (result.settings.config_values(), result.prediction.summary(vram_gib))))


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
