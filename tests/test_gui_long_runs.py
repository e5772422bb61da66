"""The window over long runs and their companions (under Xvfb, as tests/test_gui.py): the loss tab never stalls the
Tk main loop, whatever the run's length; the gallery follows the run being trained; the queue's failures are shown
whole; the memory plan reports its progress and can be cancelled."""
import threading
import time

import pytest

pytest.importorskip("tkinter", reason="this Python has no tkinter")

from gui_helpers import ARTEFACTS, app, display, run_until, screenshot, settle  # noqa: E402,F401

STALL_LIMIT_S = 0.1


class Probe:
    """A Tk round trip every 20 ms: the longest gap between two is the longest the main loop was blocked."""

    def __init__(self, window):
        self.window, self.gaps, self.running = window, [], True
        self.last = time.perf_counter()
        window.after(20, self._tick)

    def _tick(self):
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now
        if self.running:
            self.window.after(20, self._tick)

    @property
    def longest(self) -> float:
        return max(self.gaps)


def _write_steps(folder, first: int, last: int, wall_time: float | None = None) -> None:
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(folder))
    for step in range(first, last + 1):
        writer.add_scalar("loss/step", 0.2 + 0.1 / step ** 0.5, step, walltime=wall_time)
        writer.add_scalar("lr/group_0", 1e-4, step, walltime=wall_time)
        if step % 100 == 0:
            writer.add_scalar("validation/loss", 0.25, step, walltime=wall_time)
    writer.close()


def test_the_loss_tab_follows_a_run_of_20000_steps_without_stalling_the_window(app, tmp_path):
    from modules.ui.CtkLossView import CURRENT

    workspace = tmp_path / "ws"
    name = "2026-01-01_10-00-00"
    folder = workspace / "tensorboard" / name
    _write_steps(folder, 1, 19900)
    app.fields["workspace_dir"].set_text(str(workspace))
    app.controller.last_run_name = name   # the window's run, as after its plan event
    view = app.loss_view
    app.tabview.set("loss")
    settle(app, 0.5)
    probe = Probe(app)
    view.run_menu.set(CURRENT)
    view.reload()                          # as the tab's reload button, or a run's end
    # the run goes on: its last 100 steps are appended while the tab shows it
    writer = threading.Thread(target=_write_steps, args=(folder, 19901, 20000), daemon=True)
    assert run_until(app, lambda: view.run is not None and view.run.steps() == (1, 19900), 60)
    writer.start()
    assert run_until(app, lambda: not writer.is_alive() and view.run.steps() == (1, 20000)
                     and view.drawn_version == view.follower.version, 60)
    settle(app, 0.5)
    probe.running = False
    print(f"longest main loop block: {probe.longest * 1000:.0f} ms over {len(probe.gaps)} probes")
    assert probe.longest < STALL_LIMIT_S, f"the main loop was blocked for {probe.longest * 1000:.0f} ms"
    # what was drawn is the whole run: the label names its steps, and the lines hold a few thousand points
    labels = [view.canvas.itemcget(item, "text") for item in view.canvas.find_all()
              if view.canvas.type(item) == "text"]
    assert f"{name}: steps 1-20000" in labels
    lines = [item for item in view.canvas.find_all() if view.canvas.type(item) == "line"]
    assert max(len(view.canvas.coords(item)) for item in lines) <= 4 * 1060 * 2
    screenshot(app, "loss-20000-steps")
    # not shown, not drawn: the follower reads on, the tab waits until it is shown again
    app.tabview.set("model")
    drawn = view.draw_count
    _write_steps(folder, 20001, 20010)
    assert run_until(app, lambda: view.run.steps() == (1, 20010), 30)
    settle(app, 0.7)
    assert view.draw_count == drawn
    app.tabview.set("loss")
    assert run_until(app, lambda: view.draw_count > drawn and view.drawn_version == view.follower.version, 10)


def test_the_queue_checks_a_job_when_added_and_shows_a_failure_whole(app, tmp_path, tiny_model, squares_dataset):
    import shutil

    from gui_helpers import _point_at_test_data

    queue = app.controller.job_queue()
    while queue.jobs:
        queue.remove(0)
    missing = tmp_path / "missing"
    _point_at_test_data(app, tmp_path, tiny_model, squares_dataset, max_steps="2")
    app.fields["data.concepts.0.path"].set_text(str(missing))
    dialogs = len(app.dialogs)
    app.add_to_queue()                     # checked as Start checks: refused before it waits in the queue
    assert run_until(app, lambda: len(app.dialogs) > dialogs, 60)
    message = f"data.concepts.0.path: {str(missing)!r} does not exist"
    assert message in app.dialogs[-1].winfo_children()[0].get("1.0", "end")
    app.dialogs[-1].destroy()
    assert not app.controller.job_queue().jobs
    data = tmp_path / "data"
    shutil.copytree(squares_dataset, data)
    app.fields["data.concepts.0.path"].set_text(str(data))
    app.add_to_queue()
    assert run_until(app, lambda: len(app.queue_view.rows) == 1, 60), app.log_box.get("1.0", "end")[-2000:]
    shutil.rmtree(data)                    # gone before it runs: checked again there
    app.tabview.set("queue")
    app.queue_view.run_queue()
    message = f"data.concepts.0.path: {str(data)!r} does not exist"
    # the run's end, and the window's poll of the queue's events after it (the job list is redrawn there)
    assert run_until(app, lambda: not app.controller.running and app.controller.run.status.startswith("queue:")
                     and message in app.queue_view.rows[0]["detail"], 120), app.log_box.get("1.0", "end")[-2000:]
    assert app.controller.job_queue().jobs[0].state == "failed"
    assert message in app.queue_view.rows[0]["detail"]            # the job list: the whole message
    assert message in app.log_box.get("1.0", "end")                # and the log pane
    settle(app, 0.3)
    screenshot(app, "queue-failed-job")
    # a second runner: `queue run` in a shell holds the queue; the window's Run queue says who, and runs nothing
    app.queue_view._edit("retry", 0)
    lock = app.controller.job_queue().runner_lock().acquire()
    try:
        dialogs = len(app.dialogs)
        app.queue_view.run_queue()
        assert len(app.dialogs) == dialogs + 1 and not app.controller.running
        import os
        assert f":{os.getpid()} (host:pid)" in app.dialogs[-1].winfo_children()[0].get("1.0", "end")
        app.dialogs[-1].destroy()
    finally:
        lock.release()
    assert app.controller.job_queue().jobs[0].state == "waiting"
    app.queue_view._edit("remove", 0)


def _write_preview(run_folder, row: str, step: int, epoch: int) -> None:
    import json

    import numpy as np

    from modules.util.video_frames import write_video
    folder = run_folder / row
    folder.mkdir(parents=True, exist_ok=True)
    frames = np.full((3, 32, 32, 3), (step * 7) % 255, dtype=np.uint8)
    write_video(folder / f"{step}-{epoch}.mp4", frames, 16)
    (folder / f"{step}-{epoch}.json").write_text(json.dumps({"prompt": row.split("-", 1)[1], "seed": 1}))


def test_the_gallery_follows_the_run_being_trained_newest_first_and_scrolls_both_ways(app, tmp_path):
    """The trainer's side is stood in for by a thread that sends the run's plan event and writes previews where
    TrainingSampler writes them (<workspace>/samples/<run>/<index>-<slug>/<step>-<epoch>.mp4, with the settings
    beside): the gallery's part is what is tested."""
    workspace = tmp_path / "ws"
    rows = [f"{index}-sample_{index}" for index in range(6)]
    _write_preview(workspace / "samples" / "2026-01-01_08-00-00", rows[0], 5, 0)   # an earlier run
    app.fields["workspace_dir"].set_text(str(workspace))
    app.tabview.set("gallery")
    gallery = app.gallery_view
    gallery.refresh()
    assert gallery.run_menu.get() == "2026-01-01_08-00-00"
    name = "2026-01-02_09-00-00"
    run_folder = workspace / "samples" / name
    more, done = threading.Event(), threading.Event()

    def trainer():
        app.controller.events.put(("plan", {"epochs": 4, "total_steps": 100, "batches_per_epoch": 25,
                                            "resumed_from": None, "run_name": name}))
        for step in range(0, 60, 5):
            for row in rows:
                _write_preview(run_folder, row, step, step // 25)
        more.wait(60)
        for row in rows:
            _write_preview(run_folder, row, 80, 3)
        done.wait(60)

    app.controller._thread = threading.Thread(target=trainer, daemon=True)
    app.controller._thread.start()
    try:
        # listed and shown at its plan, before any reload
        assert run_until(app, lambda: gallery.run_menu.get() == name, 10)
        assert name in gallery.run_menu.cget("values")
        assert run_until(app, lambda: len(gallery.cells) == 72 and gallery.thumbnails_shown == 72, 60), \
            (len(gallery.cells), gallery.thumbnails_shown)
        settle(app, 0.3)
        newest = gallery._labels[("step", 55)]
        assert int(newest.grid_info()["column"]) == 1                      # newest step first
        canvas = gallery.scroll.canvas
        assert canvas.xview()[0] == 0 and canvas.xview()[1] < 1          # wider than the window: scrolls sideways
        assert canvas.yview()[1] < 1                                       # and taller: scrolls down
        assert gallery.scroll.x_bar.winfo_ismapped() and gallery.scroll.y_bar.winfo_ismapped()
        screenshot(app, "gallery-following")
        canvas.xview_moveto(1.0)
        canvas.yview_moveto(1.0)
        settle(app, 0.2)
        assert canvas.xview()[1] == 1 and canvas.yview()[1] == 1
        # the next preview step: added in front, the thumbnails already decoded kept (not decoded again)
        kept = gallery.cells[(rows[0], 0)]
        more.set()
        assert run_until(app, lambda: len(gallery.cells) == 78 and gallery.thumbnails_shown == 78, 30)
        assert gallery.cells[(rows[0], 0)] is kept
        assert int(gallery._labels[("step", 80)].grid_info()["column"]) == 1
        assert canvas.xview()[0] == 0                                      # the newest column in view again
        cell = gallery.cells[(rows[1], 80)]["cell"]
        assert cell.tooltip.startswith("step 80 (epoch 4)")               # counted from 1, as the progress bar
    finally:
        more.set()
        done.set()
        app.controller._thread.join(10)
        app.controller.poll_events()


def test_the_gallery_scrolls_sideways_with_shift_and_the_wheel_and_keeps_its_prompts_in_view(app, tmp_path):
    """Real X input (xdotool): Shift+wheel over the grid scrolls it sideways, the wheel alone down; the prompt
    labels stay at the left, each beside its row, wherever the grid is scrolled."""
    from gui_helpers import xdotool

    workspace = tmp_path / "ws"
    rows = [f"{index}-sample_{index}" for index in range(6)]
    for step in range(0, 160, 10):
        for row in rows:
            _write_preview(workspace / "samples" / "2026-01-03_08-00-00", row, step, 0)
    app.fields["workspace_dir"].set_text(str(workspace))
    app.tabview.set("gallery")
    gallery = app.gallery_view
    gallery.refresh()
    gallery.run_menu.set("2026-01-03_08-00-00")
    gallery.show_run()
    assert run_until(app, lambda: gallery.thumbnails_shown == len(gallery.cells) == 96, 60)
    settle(app, 0.3)
    canvas = gallery.scroll.canvas
    assert canvas.xview()[0] == 0 and canvas.yview()[0] == 0
    cell = gallery.cells[(rows[1], 150)]["label"]
    xdotool("mousemove", "--sync", str(cell.winfo_rootx() + 20), str(cell.winfo_rooty() + 20))
    xdotool("keydown", "shift", "click", "--repeat", "3", "5", "keyup", "shift")
    assert run_until(app, lambda: canvas.xview()[0] > 0, 5), canvas.xview()
    assert canvas.yview()[0] == 0                                          # sideways only
    xdotool("click", "--repeat", "2", "5")
    assert run_until(app, lambda: canvas.yview()[0] > 0, 5), canvas.yview()

    def in_view_beside_its_row(row: str) -> bool:
        label, cell = gallery._labels[("row", row)], gallery.cells[(row, 0)]["label"]
        left = gallery.scroll.outer.winfo_rootx()
        right = canvas.winfo_rootx() + canvas.winfo_width()
        return left <= label.winfo_rootx() and label.winfo_rootx() + label.winfo_width() <= right and \
            abs(label.winfo_rooty() - cell.winfo_rooty()) <= 1

    canvas.xview_moveto(1.0)   # the oldest steps: the prompts stay at the left, beside their rows
    canvas.yview_moveto(1.0)
    settle(app, 0.3)
    assert all(in_view_beside_its_row(row) for row in rows[-3:])
    screenshot(app, "gallery-scrolled")


def test_the_end_of_run_panel_leaves_the_whole_loss_graph_in_view(app, tmp_path):
    """The end-of-run panel takes room from the tabs: the loss graph shrinks to the space left (its step axis
    in view), and a validation point added above every training loss is drawn inside the plot."""
    from modules.ui.CtkLossView import COLORS, CURRENT

    workspace = tmp_path / "ws"
    name = "2026-01-04_10-00-00"
    folder = workspace / "tensorboard" / name
    _write_steps(folder, 1, 99)
    app.fields["workspace_dir"].set_text(str(workspace))
    app.controller.last_run_name = name
    view = app.loss_view
    app.tabview.set("loss")
    view.run_menu.set(CURRENT)
    view.reload()
    assert run_until(app, lambda: view.run is not None and view.run.steps() == (1, 99)
                     and view.drawn_version == view.follower.version, 30)
    app.end_panel.show({"written": [], "report": "wrote nothing"}, app.controller.run)
    try:
        tab = app.tabview.tab("loss")
        assert run_until(app, lambda: view.canvas.winfo_rooty() + view.canvas.winfo_height()
                         <= tab.winfo_rooty() + tab.winfo_height(), 5), \
            (view.canvas.winfo_height(), tab.winfo_height())
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(folder))
        writer.add_scalar("validation/loss", 0.9, 100)   # far above the training loss (0.2 .. 0.3)
        writer.close()
        assert run_until(app, lambda: "validation" in view.run.curves and view.drawn_version == view.follower.version,
                         30)
        settle(app, 0.3)
        canvas = view.canvas
        step_label = next(item for item in canvas.find_all() if canvas.type(item) == "text"
                          and canvas.itemcget(item, "text") == "step")
        assert canvas.bbox(step_label)[3] <= canvas.winfo_height()     # the step axis is on screen
        _, top, _, bottom = view._frame
        validation = [item for item in canvas.find_all() if canvas.itemcget(item, "fill") == COLORS["validation"]]
        assert validation
        for item in validation:
            ys = canvas.coords(item)[1::2]
            assert top - 2 <= min(ys) and max(ys) <= bottom + 2, (ys, top, bottom)
        screenshot(app, "loss-with-end-panel")
    finally:
        app.end_panel.hide()


def test_open_output_folder_without_a_file_manager_shows_the_path_to_copy(app, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))
    monkeypatch.chdir(tmp_path)
    app.fields["output.destination"].set_text("out/lora.safetensors")
    dialogs = len(app.dialogs)
    app.open_output_folder()
    assert len(app.dialogs) == dialogs + 1
    dialog = app.dialogs[-1]
    text = dialog.winfo_children()[0].get("1.0", "end")
    assert str(tmp_path / "out") in text and "Errno" not in text
    import customtkinter as ctk
    copy = next(w for w in dialog.winfo_children() if isinstance(w, ctk.CTkButton) and w.cget("text") ==
                "copy the path")
    copy.invoke()
    assert app.clipboard_get() == str(tmp_path / "out")
    dialog.destroy()


def test_the_stack_check_is_drawn_beside_the_loss_on_its_own_scale(app, tmp_path):
    """Each accelerated preview's stack check (docs/distilled.md) is a dot on the loss graph, on its own scale from 0
    (labelled in the plot's corner), and its check box hides it."""
    from torch.utils.tensorboard import SummaryWriter

    from modules.ui.CtkLossView import COLORS
    from modules.ui.LossHistory import STACK_CHECK

    workspace = tmp_path / "ws"
    name = "2026-01-05_10-00-00"
    folder = workspace / "tensorboard" / name
    _write_steps(folder, 1, 60)
    writer = SummaryWriter(str(folder))
    checks = {0: 0.21, 20: 0.25, 40: 0.38, 60: 0.52}   # a LoRA drifting from what it does on the base
    for step, distance in checks.items():
        writer.add_scalar("stack_check/0-a-red-square", distance, step)
    writer.close()
    app.fields["workspace_dir"].set_text(str(workspace))
    view = app.loss_view
    app.tabview.set("loss")
    view.refresh_runs()
    view.run_menu.set(name)
    view.reload()
    assert run_until(app, lambda: view.run is not None and STACK_CHECK in view.run.curves
                     and view.drawn_version == view.follower.version, 30)
    settle(app, 0.3)
    canvas = view.canvas

    def dots():
        return [canvas.coords(item) for item in canvas.find_all()
                if canvas.type(item) == "oval" and canvas.itemcget(item, "fill") == COLORS[STACK_CHECK]]
    found = dots()
    assert len(found) == len(checks)
    left, top, right, bottom = view._frame
    centres = sorted(((x0 + x1) / 2, (y0 + y1) / 2) for x0, y0, x1, y1 in found)
    assert all(left - 1 <= x <= right + 1 and top - 1 <= y <= bottom + 1 for x, y in centres)
    assert [y for _, y in centres] == sorted((y for _, y in centres), reverse=True)   # climbing: higher on screen
    labels = [canvas.itemcget(item, "text") for item in canvas.find_all() if canvas.type(item) == "text"]
    assert "stack check: 0 (foot) to 0.572 (top)" in labels
    screenshot(app, "loss-stack-check")
    view.shown_curves[STACK_CHECK].set(False)
    view.draw()
    assert dots() == []
    view.shown_curves[STACK_CHECK].set(True)


def test_the_tools_sample_form_runs_with_the_sampling_tabs_accelerator(app, tmp_path):
    """The sample form's accelerator menu (the sampling tab's, by default) puts that accelerator's files and schedule
    on the command line it runs (tests/test_ui_accelerator.py runs such a command); `none` leaves them off."""
    view = app.tools_view
    app.tabview.set("tools")
    for name, text in (("file", str(tmp_path / "lightx2v.safetensors")), ("strength", "0.8"), ("steps", "4")):
        app.config_state.set_text(f"sampling.accelerator.{name}", text)
    commands = []
    run = view._run
    view._run = commands.append   # the command line the Run button builds, kept instead of started
    try:
        view.values["sample.prompt"].set("a red square moving left")
        view.sample()
        view.values["sample.accelerator"].set("none")
        view.sample()
    finally:
        view._run = run
        view.values["sample.accelerator"].set("the sampling tab's")
        app.config_state.set_text("sampling.accelerator.file", "")
    accelerated, plain = commands
    assert accelerated[accelerated.index("--accelerator") + 1] == f"{tmp_path / 'lightx2v.safetensors'}:0.8"
    assert accelerated[accelerated.index("--accelerator-timesteps") + 1] == "1000,750,500,250"
    assert "--steps" not in accelerated and "--accelerator" not in plain and "--steps" in plain
    settle(app, 0.3)
    assert view.rows["sample.accelerator"][1].winfo_ismapped() and view.rows["compare.accelerator"][1].winfo_exists()
    screenshot(app, "tab-tools-accelerator")
