"""Closing the window while the memory planner traces: the planner's close() stops it between traces and waits for
the trace running, so the process exits cleanly (a worker still inside torch at interpreter exit aborts it with
"terminate called", exit code 134). Run in a subprocess: the exit code is what is tested."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, threading
from modules.ui.MemoryPlanController import MemoryPlanController
from modules.ui.UIState import UIState
traced = threading.Event()

class Watched(MemoryPlanController):
    def _report(self, done, at_most, text):
        super()._report(done, at_most, text)
        traced.set()

controller = Watched(UIState({"model": {"base_model_name": sys.argv[1]}, "gradient_checkpointing": True,
                              "device": "cpu", "data": {"resolution": 64, "frame_buckets": [9]},
                              "optimizer": {"optimizer": "ADAMW"}}))
assert controller.fit(4.0, "least")
assert traced.wait(300)                     # planning: one trace made, more to come
assert controller.close()                   # what the window's close calls
assert not controller.predict(None) and not controller.fit(4.0, "fastest")   # nothing starts after it
print("closed after", controller.progress[0], "of", controller.progress[1], "traces")
"""


def test_closing_during_a_fit_stops_the_planner_and_exits_cleanly(tiny_model):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model("wan2.1-t2v"))], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    done, at_most = [int(n) for n in result.stdout.split()[2::2]]
    assert 1 <= done < at_most   # stopped mid-fit, not run to its end
