"""The training tab's "fit to my card" without a display (modules/ui/MemoryPlanController.py): progress and cancel
while it plans, plans kept by config hash (asked again: answered at once), the objective (fastest that fits, least
memory), what each chosen switch buys, a memory line that follows the card box and says what to do, and that the
figure is a GPU figure on a CPU run."""
import re
import time

from modules.ui.MemoryPlanController import NOTHING_FITS_ADVICE, MemoryPlanController
from modules.ui.UIState import UIState


def _wait(controller, timeout=300):
    controller.wait(timeout)
    return controller.poll()


def test_fit_to_my_card_reports_progress_cancels_keeps_its_plans_and_says_what_each_switch_buys(tiny_model):
    state = UIState({"model": {"base_model_name": str(tiny_model("wan2.1-t2v"))}, "gradient_checkpointing": True,
                     "device": "cpu", "data": {"resolution": 64, "frame_buckets": [9]},
                     "optimizer": {"optimizer": "ADAMW"}})
    reports = []

    class Pressed(MemoryPlanController):
        """"cancel" pressed while the first trace is reported (a tiny model's traces are too quick to catch)."""

        def _report(self, done, at_most, text):
            super()._report(done, at_most, text)
            reports.append((self.progress, self.status()))
            if not reports[1:]:   # the first fit only
                self.cancel()
                reports.append(self.status())

    controller = Pressed(state)
    # progress while it plans, and cancel between two traces: nothing set
    assert controller.fit(4.0, "least")
    text = _wait(controller)
    assert controller.cancelled and text.startswith("memory: fit cancelled"), text
    (progress, status), cancelling = reports       # one trace made, none after the cancel
    assert progress[0] == 1 and progress[1] > 1 and status.startswith(f"memory: planning… trace 2 of at most "
                                                                      f"{progress[1]}")
    assert "cancelling after the current trace" in cancelling
    assert state.get("gradient_checkpointing") is True and not controller.busy

    # least memory: every switch at its most, each one's share said (memory from the traces, time from the cost)
    assert controller.fit(4.0, "least")
    text = _wait(controller)
    assert text.startswith("fits 4 GiB: ") and "(least memory)" in text, text
    assert "a GPU figure" in text or "GPU figures" in text          # a CPU run: said
    assert "performance.activation_offload = True" in text and "performance.block_swap = 2" in text
    # the attention inputs in chunks are a switch of the search too (performance.chunk_attention_inputs)
    assert [line.split(":")[0] for line in controller.details[:4]] == ["checkpointing every 1", "activation offload",
                                                                       "attention inputs in chunks", "block swap 2"]
    assert all(re.search(r"\([+-][\d.]+ [MG]iB, \+[\d.]+ m?s/step\)$", line) for line in controller.details[:4]), \
        controller.details

    # asked again for the config as it was: answered from the plans kept, at once
    for path, value in {"gradient_checkpointing": True, "performance.checkpoint_every": 1,
                        "performance.block_swap": 0, "performance.activation_offload": False,
                        "performance.chunk_attention_inputs": False}.items():
        state.set(path, value)
    started = time.perf_counter()
    assert controller.fit(4.0, "least")
    assert controller.poll() is not None and time.perf_counter() - started < 0.5
    assert state.get("performance.block_swap") == 2                  # the same answer, set again

    # the fastest that fits, from the traces kept (no trace of them again), against the switches as set
    traces = sum(len(memo) for memo in controller._traces.values())
    assert controller.fit(4.0, "fastest")
    text = _wait(controller)
    assert "; fit set gradient_checkpointing = False, performance.block_swap = 0" in text, text
    assert "(fastest that fits)" in text
    assert any(line.startswith("against the switches as set") and "s/step faster on a nominal GPU" in line
               for line in controller.details), controller.details
    assert sum(len(memo) for memo in controller._traces.values()) == traces   # every setting was traced before

    # nothing fits: what to do
    assert controller.fit(0.1)
    text = _wait(controller)
    assert text.startswith("nothing fits 0.1 GiB") and NOTHING_FITS_ADVICE in text, text

    # the line follows the card box with the kept prediction (no new trace), and says what to do
    assert controller.predict(4.0)
    text = controller.text if not controller.busy else _wait(controller)
    assert text.startswith("fits 4 GiB"), text
    controller.card_changed(0.1)
    assert controller.text.startswith("does not fit 0.1 GiB") and 'press "fit to my card"' in controller.text
    assert "a GPU figure" in controller.text and not controller.busy


def test_a_prediction_reports_each_trace_while_it_plans():
    """A prediction (not only a fit) says how far it is: the released 1.3B (30 blocks, real width) at a tiny shape is
    composed from cut traces, each reported from the worker as it ends (at most: both cuts' traces, 3 each)."""
    state = UIState({"model": {"base_model_name": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"}, "device": "cpu",
                     "data": {"resolution": 64, "frame_buckets": [9]}, "optimizer": {"optimizer": "ADAMW"}})
    reports = []

    class Watched(MemoryPlanController):
        def _report(self, done, at_most, text):
            super()._report(done, at_most, text)
            reports.append((self.progress, self.status(), text))

    controller = Watched(state)
    assert controller.predict(24.0)
    text = _wait(controller)
    assert text.startswith("fits 24 GiB"), text
    progress = [progress for progress, _status, _text in reports]
    assert progress[:3] == [(1, 6), (2, 6), (3, 6)] and progress[-1] == (6, 6), reports
    assert reports[0][1].startswith("memory: planning… trace 2 of at most 6")
    # the cut traces run side by side (trace_pool.py): each is reported as it ends, in whatever order they end
    assert sorted(text for _progress, _status, text in reports[:3]) == ["2 of 30 blocks", "3 of 30 blocks",
                                                                        "4 of 30 blocks"]
    assert controller._predictions[next(iter(controller._predictions))].how.startswith("composed from 3 traces")
