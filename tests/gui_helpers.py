"""The window's tests' shared parts: an X display (a private Xvfb), one window per test module (from
scripts/train_ui.py's create_app), the Tk main loop run until a condition holds, real X input (xdotool) and
screenshots (ImageMagick's `import`) written to workspace/test-artefacts/gui/."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "training_presets" / "#demo tiny CPU.json"
ARTEFACTS = ROOT / "workspace" / "test-artefacts" / "gui"


def _has(tool: str) -> bool:
    return shutil.which(tool) is not None


@pytest.fixture(scope="session")
def display():
    """An X display: the session's when it answers, else a private Xvfb (one per test module that imports this
    fixture). Skips (with the reason) without one. The servers live until the test session ends: Tk's event loop
    serves every display connection of the process, and one whose server has gone (a window of an earlier module
    not yet collected) makes Xlib end the whole process, silently, in the next module's window."""
    for tool in ("Xvfb", "xdotool", "import"):
        if not _has(tool) and not (tool == "Xvfb" and os.environ.get("DISPLAY")):
            pytest.skip(f"{tool} is not installed; run-tests.sh installs xvfb, xdotool and imagemagick with apt-get "
                        f"where it can")
    previous = os.environ.get("DISPLAY")
    server = None
    if not _has("Xvfb"):
        yield previous
        return
    # Xvfb picks a free display number itself and writes it to the pipe: test processes running side by side
    # (pytest-xdist workers) never share or fight over a server
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1400x1000x24", "-nolisten",
                               "tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_end,))
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        number = answer.readline().strip()
    if not number:
        pytest.skip(f"Xvfb did not start (exit code {server.wait(10)})")
    os.environ["DISPLAY"] = f":{number}"
    try:
        yield os.environ["DISPLAY"]
    finally:
        server.terminate()
        server.wait(10)
        if previous is None:
            os.environ.pop("DISPLAY", None)
        else:
            os.environ["DISPLAY"] = previous


@pytest.fixture(scope="module")
def app(display, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_ui
    from modules.ui.TrainController import TrainController

    workspace = tmp_path_factory.mktemp("workspace")
    controller = TrainController(last_used=workspace / "ui" / "last-used.json",
                                 queue_path=workspace / "queue" / "queue.json")
    window = train_ui.create_app(str(DEMO), controller=controller)
    assert run_until(window, lambda: window.winfo_ismapped() and window.preloaded, 120)
    yield window
    window.destroy()
    # Tk objects must be finalised on the thread that made them: a collection in a later test's worker thread
    # that finds them would abort the interpreter (Tcl_AsyncDelete), taking pytest down with exit 134
    import gc
    gc.collect()


def run_until(app, condition, timeout: float, every_ms: int = 50) -> bool:
    """Runs the Tk main loop until `condition()` holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    result = {}

    def check():
        if condition():
            result["ok"] = True
        elif time.monotonic() > deadline:
            result["ok"] = False
        else:
            app.after(every_ms, check)
            return
        app.quit()

    app.after(every_ms, check)
    app.mainloop()
    return result["ok"]


def settle(app, seconds: float = 0.3) -> None:
    end = time.monotonic() + seconds
    run_until(app, lambda: time.monotonic() > end, seconds + 5)


def screenshot(window, name: str) -> Path:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTEFACTS / f"{name}.png"
    subprocess.run(["import", "-window", window.wm_frame(), str(path)], check=True, timeout=30)
    return path


def assert_not_empty(path: Path, top: int = 90, bottom: int = 560) -> None:
    """The tab's area holds drawn content: many colours and some contrast, not a blank panel."""
    from PIL import Image

    pixels = np.asarray(Image.open(path).convert("L"))[top:bottom]
    assert pixels.std() > 12 and len(np.unique(pixels)) > 40, path


def xdotool(*args: str) -> None:
    subprocess.run(["xdotool", *args], check=True, timeout=30)


def type_into(app, widget, text: str) -> None:
    """Real X input: click the entry, clear it, type."""
    x = widget.winfo_rootx() + widget.winfo_width() // 2
    y = widget.winfo_rooty() + widget.winfo_height() // 2
    xdotool("mousemove", "--sync", str(x), str(y), "click", "1")
    settle(app, 0.2)
    xdotool("key", "--delay", "10", "End", *(["BackSpace"] * 10))
    xdotool("type", "--delay", "80", "--", text)
    settle(app, 0.3)


def _point_at_test_data(app, tmp_path, tiny_model, squares_dataset, **values):
    settings = {"demo_assets": "false", "model.base_model_name": str(tiny_model("wan2.1-t2v")),
                "workspace_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"),
                "output.destination": str(tmp_path / "out" / "lora.safetensors"),
                "data.concepts.0.path": str(squares_dataset), "tensorboard": "false",
                "sampling.samples_file": "", **values}
    for path, text in settings.items():
        app.fields[path].set_text(text)
    assert app.controller.state.problems == [], app.controller.state.problems
