"""Makes the GUI pictures of docs/gui/ (and the README's) from a real run of the built-in demo, under Xvfb.

  run-cmd.sh gui_screenshots                      # writes docs/gui/*.png
  run-cmd.sh gui_screenshots --out /tmp/shots --keep-workdir

It works in a fresh folder (--workdir, default a temporary one) so that the pictures show the demo preset's own
relative paths (workspace/demo/...), never a test's: it opens the window on "#demo tiny CPU", photographs every tab,
presses Start, photographs the sampling tab while the demo trains and shows its previews, and after the run the
end-of-run panel, the loss graph, the gallery, the queue, the concept window with its dataset viewer and captioner,
the E2V elements drawing of the demo's E2V set, a field with an invalid value, and on the VACE demo set (with a
tiny VACE model) the control tab, the dataset viewer's companions, the tools tab's VACE sample form and the training
tab's multi-GPU section. The demo runs as the preset says
(every step of it): minutes on a CPU. Needs Xvfb and ImageMagick's `import` (run-tests.sh installs them).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "training_presets" / "#demo tiny CPU.json"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="run-cmd.sh gui_screenshots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "gui"), help="where the PNGs go (default docs/gui)")
    parser.add_argument("--workdir", default=None, help="the folder the demo runs in (default: a temporary one)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the demo's folder afterwards")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the demo run may take (default 3600)")
    return parser.parse_args(argv)


class Xvfb:
    """A private X server (1400x1000, so the 1280x900 window fits whole)."""

    def __enter__(self):
        if not shutil.which("Xvfb") or not shutil.which("import"):
            raise SystemExit("gui_screenshots: needs Xvfb and ImageMagick's import (apt-get install xvfb imagemagick)")
        number = 200 + os.getpid() % 500
        self.server = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", "1400x1000x24", "-nolisten", "tcp"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        socket = Path(f"/tmp/.X11-unix/X{number}")
        deadline = time.monotonic() + 20
        while not socket.exists():
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise SystemExit(f"gui_screenshots: Xvfb :{number} did not start")
            time.sleep(0.05)
        os.environ["DISPLAY"] = f":{number}"
        return self

    def __exit__(self, *exc):
        self.server.terminate()
        self.server.wait(10)


class Camera:
    def __init__(self, app, out: Path):
        self.app, self.out = app, out
        self.taken: list[Path] = []

    def run_until(self, condition, timeout: float, what: str) -> None:
        """Runs the Tk loop until `condition()` holds; SystemExit naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit(f"gui_screenshots: timed out waiting for {what}\n"
                                 f"{self.app.log_box.get('1.0', 'end')[-2000:]}")
            self.app.update()
            time.sleep(0.02)

    def settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.run_until(lambda: time.monotonic() > end, seconds + 5, "the window to settle")

    def shoot(self, window, name: str) -> None:
        self.settle(0.5)
        path = self.out / f"{name}.png"
        subprocess.run(["import", "-window", window.wm_frame(), str(path)], check=True, timeout=60)
        self.taken.append(path)
        print(f"wrote {path}", flush=True)


def tab_file_name(tab: str) -> str:
    return "tab-" + tab.replace(" / ", "-").replace(" ", "-")


def take(app, camera: Camera, timeout: float) -> None:
    from modules.util.demo_e2v import demo_e2v_config, make_e2v_dataset

    camera.run_until(lambda: app.winfo_ismapped() and app.preloaded, 300, "the window")
    before_run = [tab for tab in app.tabs if tab not in ("loss", "gallery", "queue", "elements", "tools", "control")]
    for tab in before_run:
        app.tabview.set(tab)
        camera.shoot(app, tab_file_name(tab))

    app.tabview.set("general")
    app.start()
    camera.run_until(lambda: app.controller.run.total_steps and app.controller.run.step >= 60, timeout,
                     "the demo to pass step 60")
    app.tabview.set("sampling")
    app.sampling_view.refresh_previews()
    camera.run_until(lambda: app.sampling_view.frames_shown > 10, 120, "the preview to play")
    camera.shoot(app, "training-sampling")
    camera.run_until(lambda: not app.controller.running and not app.controller.run.running, timeout,
                     "the demo run to end")
    if not app.controller.run.status.startswith("done"):
        raise SystemExit(f"gui_screenshots: the demo run ended with {app.controller.run.status!r}")
    app.tabview.set("general")
    camera.shoot(app, "run-end")
    app.end_panel.hide()   # the graph and the grid get the whole height
    for tab in ("loss", "gallery"):
        app.tabview.set(tab)
        camera.settle(2)
        camera.shoot(app, tab_file_name(tab))

    # the tools tab: the end panel's "sample it" fills the form with the new LoRA; Run, and the result plays
    app.end_panel.prefill_sample_form()
    app.tabview.set("tools")
    app.tools_view.sample()
    camera.run_until(lambda: app.tools_view.player.path is not None and app.tools_view.player.frame is not None,
                     600, "the tools tab's sample to play")
    camera.shoot(app, "tab-tools")

    # the queue: the demo config added twice, waiting
    for name in ("demo_lora_rank4", "demo_lora_rank16"):
        app.fields["lora.rank"].set_text(name.rsplit("rank", 1)[1])
        app.fields["output.destination"].set_text(f"workspace/demo/output/{name}.safetensors")
        app.add_to_queue()
    app.tabview.set("queue")
    camera.shoot(app, "tab-queue")
    app.load_file(DEMO)

    # the concept window, its dataset viewer and the captioner
    app.tabview.set("concepts")
    window = app.concepts_view.open_window(0)
    camera.run_until(lambda: window.result is not None, 120, "the concept statistics")
    camera.shoot(window, "concept-window")
    viewer = window.browse()
    camera.run_until(lambda: viewer.loaded, 120, "the dataset viewer")
    camera.shoot(viewer, "dataset-viewer")
    viewer.destroy()
    captioner = window.caption()
    camera.run_until(captioner.winfo_ismapped, 30, "the captioner window")
    camera.shoot(captioner, "caption-window")
    captioner.close()
    window.close()

    # an invalid value shows the CLI's message beside its field
    app.tabview.set("training")
    app.fields["optimizer.learning_rate"].set_text("-1")
    camera.shoot(app, "invalid-value")
    app.fields["optimizer.learning_rate"].set_text("0.002")

    # the elements tab on the demo's E2V set (the layout of seed 001)
    e2v = make_e2v_dataset(Path("workspace/demo/e2v"))
    config = e2v / "e2v_config.json"
    import json
    config.write_text(json.dumps(demo_e2v_config("workspace/demo/e2v"), indent=2))
    app.fields["data.frame_buckets"].set_text("17")
    app.elements_view.import_file(str(config))
    app.tabview.set("elements")
    camera.run_until(lambda: app.elements_view.last_drawing is not None, 60, "the elements drawing")
    camera.shoot(app, "tab-elements")
    control_models(app, camera)


def control_models(app, camera: Camera) -> None:
    """The VACE demo set beside a tiny VACE model (only its configs are read: nothing is sampled here)."""
    from modules.util.demo_vace import make_vace_dataset
    from modules.util.tiny_pipelines import make_tiny_model

    app.load_file(DEMO)
    model = make_tiny_model("wan2.1-vace", Path("workspace/demo/vace-model"))
    data = make_vace_dataset(Path("workspace/demo/vace"), clips_per_class=1)
    for path, text in {"demo_assets": "false", "model.base_model_name": str(model), "model.intended_variant": "",
                       "data.concepts.0.path": str(data), "data.resolution": "32",
                       "data.frame_buckets": "1, 5, 9"}.items():
        app.fields[path].set_text(text)
    view = app.control_view
    view.refresh()
    app.tabview.set("control")
    camera.run_until(lambda: view.loaded and view.strip.shown_index == 0, 120, "the control tab's preview")
    view.strip.set_frame(4)
    camera.run_until(lambda: view.strip.shown_index == 4, 60, "the control tab's frame 4")
    camera.shoot(app, "tab-control")
    app.tabview.set("concepts")
    window = app.concepts_view.open_window(0)
    viewer = window.browse()
    camera.run_until(lambda: viewer.loaded and viewer.strip.shown_index == 0, 120, "the VACE dataset viewer")
    camera.shoot(viewer, "dataset-viewer-vace")
    viewer.destroy()
    window.close()
    tools = app.tools_view
    tools.values["sample.base model"].set(str(model))
    tools.conditions_for_base(str(model))
    tools.values["sample.control video"].set(str(data / "blue_left_00_control"))
    tools.values["sample.reference images"].set(str(data / "blue_left_00_ref.png"))
    app.tabview.set("tools")
    tools.frame._parent_canvas.yview_moveto(0.25)
    camera.shoot(app, "tab-tools-vace")
    app.fields["multi_gpu"].set_text("true")
    app.fields["distributed.processes"].set_text("2")
    app.tabview.set("training")
    camera.settle(1)
    app.tabs["training"]._parent_canvas.yview_moveto(0.42)
    camera.shoot(app, "tab-training-multi-gpu")
    # the memory line plans the VACE model in a thread: an interpreter ending under it aborts (exit 134)
    camera.run_until(lambda: not app.training_view.memory.busy, 600, "the memory plan of the VACE model")
    app.load_file(DEMO)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="wan-gui-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)   # the demo preset's relative paths (workspace/demo/...) resolve here and show as written
    started = time.monotonic()
    try:
        with Xvfb():
            import customtkinter as ctk

            import train_ui
            from modules.ui.TrainController import TrainController
            ctk.set_appearance_mode("dark")
            controller = TrainController(last_used=workdir / "workspace" / "ui" / "last-used.json")
            app = train_ui.create_app(str(DEMO), controller=controller)
            app.geometry("1280x900+0+0")
            camera = Camera(app, out)
            try:
                take(app, camera, args.timeout)
            finally:
                if app.controller.running:
                    app.controller.stop()
                app.destroy()
    finally:
        if not args.keep_workdir and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"gui_screenshots: {len(camera.taken)} pictures in {out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
