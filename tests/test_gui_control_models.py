"""The window's parts for control and character models and for several GPUs, built and bound under Xvfb (as
tests/test_gui.py): the control tab and the dataset viewer show an item beside its companions on one frame slider,
the model tab says what the detected variant takes, the tools tab's sample form shows the conditions of the model
kind and plays a result beside its control video, and the training tab's multi-GPU section binds its fields."""
import shutil

import numpy as np
import pytest

pytest.importorskip("tkinter", reason="this Python has no tkinter")

from gui_helpers import app, assert_not_empty, display, run_until, screenshot, settle  # noqa: E402,F401


@pytest.fixture(scope="module")
def vace_setup(app, tiny_model, tmp_path_factory):
    from modules.util.demo_vace import make_vace_dataset
    data = make_vace_dataset(tmp_path_factory.mktemp("vace-data"), clips_per_class=1)
    shutil.rmtree(data / "red_left_00_control")
    work = tmp_path_factory.mktemp("vace-work")
    for path, text in {"demo_assets": "false", "model.base_model_name": str(tiny_model("wan2.1-vace")),
                       "model.intended_variant": "", "data.concepts.0.path": str(data), "data.resolution": "32",
                       "data.frame_buckets": "1, 5, 9", "data.aspect_ratios": "1.0",
                       "cache_dir": str(work / "cache"), "workspace_dir": str(work / "ws")}.items():
        app.fields[path].set_text(text)
    assert app.config_state.problems == [], app.config_state.problems
    yield data
    # the memory line plans the VACE model in a thread: the interpreter must not end under it (exit 134)
    app.training_view.memory.cancel()
    assert run_until(app, lambda: not app.training_view.memory.busy, 300)


def test_the_control_tab_shows_an_item_beside_its_control_on_one_slider(app, vace_setup):
    from modules.util.video_io import read_frames
    view = app.control_view
    view.refresh()
    app.tabview.set("control")
    assert run_until(app, lambda: view.loaded and view.strip.shown_index == 0, 60), view.note.cget("text")
    assert view.kind == "vace"
    # the settings of a VACE model's control only: no Animate section
    assert view.sections["data.control"][0].grid_info() and not view.sections["animate"][0].grid_info()
    assert view.sections["data.control"][1].cget("text") == "Wan 2.1 VACE (data.control)"
    view.item_menu.set("blue_left_00.mp4")
    view.choose("blue_left_00.mp4")
    view.strip.slider.set(6)
    view.strip._slid(6)   # as a drag of the slider does
    assert run_until(app, lambda: view.strip.shown_index == 6, 30)
    control = vace_setup / "blue_left_00_control"
    assert np.array_equal(view.strip.shown["control"], read_frames(control, [6])[0])
    assert view.strip.shown["mask"] == "mask: missing (none: optional)"
    # and the panel on screen says so (it said "missing" alone, as if the item could not train)
    columns = ["target"] + [companion.role for companion in view.strip.companions]
    assert view.strip.boxes[columns.index("mask")].cget("text") == "missing (none: optional)"
    assert view.strip.frame_label.cget("text") == "7 / 9"
    settle(app, 0.5)
    assert_not_empty(screenshot(app, "tab-control"))
    view.choose("red_left_00.mp4")   # its control folder was removed: said on its panel
    assert run_until(app, lambda: view.strip.target.endswith("red_left_00.mp4") and view.strip.shown_index == 0, 30)
    assert view.strip.shown["control"] == "control: missing (none: optional)"


def test_the_model_tab_names_the_detected_vace_model(app, vace_setup):
    app._update_variant()
    assert app.variant_label.cget("text") == "variant: Wan 2.1 VACE (VACE)"
    assert app.variant_detail.cget("text").startswith("detected VACE: Wan 2.1 VACE: takes a control video")
    assert "<name>_control.mp4" in app.variant_detail.cget("text")


def test_the_model_tab_says_why_a_presets_intended_variant_differs_from_the_model_and_follows_it(app, vace_setup):
    app.tabview.set("model")
    assert not app.intended_box.winfo_ismapped()        # intended: any model
    app.fields["model.intended_variant"].set_text("T2V")   # as a T2V preset leaves it
    settle(app, 0.3)
    assert app.intended_box.winfo_ismapped()
    note = app.intended_note.cget("text")
    assert note.startswith("the config (preset) is made for T2V") and "the chosen model is VACE" in note
    assert "Start refuses" in note
    app.follow_button.invoke()
    settle(app, 0.3)
    assert app.config_state.get("model.intended_variant") == "VACE" and app.config_state.problems == []
    assert app.fields["model.intended_variant"].variable.get() == "VACE"
    assert not app.intended_box.winfo_ismapped()
    app.fields["model.intended_variant"].set_text("")


def test_the_sample_list_gains_the_vace_condition_columns_with_the_model(app, vace_setup):
    import customtkinter as ctk
    view = app.sampling_view   # the base model was set by the fixture: the table followed it
    assert view.columns[-4:] == ("control_video", "mask_video", "reference_images", "control_scale")
    labels = [w.cget("text") for w in view.table.winfo_children() if isinstance(w, ctk.CTkLabel)]
    assert "control video" in labels and "reference images" in labels


def test_the_dataset_viewer_shows_companions_on_the_shared_slider(app, vace_setup):
    from modules.ui.CtkDatasetWindow import CtkDatasetWindow
    window = CtkDatasetWindow(app, 0)
    try:
        assert run_until(app, lambda: window.loaded and window.strip.shown_index == 0, 60), \
            window.count_label.cget("text")
        assert window.current is not None and window.current.companions
        assert set(window.strip.shown) >= {"target", "control", "reference 1", "mask"}
        assert "companions: control: " in window.info.cget("text")
        window.strip.set_frame(8)
        assert run_until(app, lambda: window.strip.shown_index == 8, 30)
        settle(app, 0.5)
        screenshot(window, "dataset-viewer-vace")
    finally:
        window.destroy()


def test_the_sample_form_shows_the_model_kinds_conditions_and_plays_beside_the_control(app, vace_setup, tmp_path):
    from modules.util.demo_vace import outline
    from modules.util.demo_assets import COLOURS, square_clip
    from modules.util.video_frames import write_video
    view = app.tools_view
    app.tabview.set("tools")
    view.conditions_for_base(app.config_state.get("model.base_model_name"))
    assert view.values["sample.conditions"].get() == "VACE"
    settle(app, 0.2)
    assert view.rows["sample.control video"][1].winfo_ismapped()
    assert not view.rows["sample.pose video"][1].winfo_ismapped()
    view.values["sample.conditions"].set("Animate")
    settle(app, 0.2)
    assert view.rows["sample.pose video"][1].winfo_ismapped()
    assert not view.rows["sample.control scale"][1].winfo_ismapped()
    view.values["sample.conditions"].set("VACE")
    clip = square_clip(COLOURS["blue"], "left", 9, 32, 0)
    write_video(tmp_path / "result.mp4", clip, 16)
    write_video(tmp_path / "control.mp4", outline(clip), 16)
    view.play(str(tmp_path / "result.mp4"), str(tmp_path / "control.mp4"))
    settle(app, 0.5)
    assert view.driving_label.winfo_ismapped() and view.driving_player.frames.shape == (9, 32, 32, 3)
    screenshot(app, "tab-tools-vace")


def test_the_multi_gpu_section_binds_and_says_what_start_launches(app, vace_setup):
    section = app.training_view.multi_gpu
    app.tabview.set("training")
    app.fields["multi_gpu"].set_text("true")
    app.fields["distributed.processes"].set_text("2")
    app.fields["device"].set_text("cpu")
    assert section.label.cget("text").startswith("0 GPU(s) visible; Start launches 2 ranks on 2 CPU processes")
    section.layout_menu.set("sharded base + CPU offload")
    section.layout_menu._command("sharded base + CPU offload")   # as a choice in the menu does
    assert (app.config_state.get("distributed.shard_base"), app.config_state.get("distributed.cpu_offload")) == \
        (True, True)
    app.config_state.set("distributed.cpu_offload", False)   # as a fit or a loaded config sets them
    app.config_state.set("distributed.shard_base", False)
    assert section.layout_menu.get() == "DDP (the whole base on every GPU)"
    app.fields["distributed.processes"].set_text("-1")
    assert "distributed.processes" in app.config_state.errors
    assert section.label.cget("text").startswith("fix the config first")
    app.fields["distributed.processes"].set_text("2")
    app.tabs["training"]._parent_canvas.yview_moveto(0.5)
    settle(app, 0.5)
    screenshot(app, "tab-training-multi-gpu")
    app.fields["multi_gpu"].set_text("false")


def test_a_vace_preview_plays_beside_its_samples_control_video(app, vace_setup, tmp_path):
    from pathlib import Path
    from modules.util.config.SampleConfig import SampleConfig
    from modules.util.demo_assets import COLOURS, square_clip
    from modules.util.sample_definitions import save_samples_json
    from modules.util.video_frames import write_video
    previews = Path(app.config_state.get("workspace_dir")) / "samples" / "run-1" / "000-a-square"
    previews.mkdir(parents=True)
    write_video(previews / "0-0.mp4", square_clip(COLOURS["blue"], "left", 9, 32, 0), 16)
    samples = tmp_path / "samples.json"
    save_samples_json([SampleConfig(prompt="a square", control_video=str(vace_setup / "blue_left_00_control"))],
                      samples)
    app.fields["sampling.samples_file"].set_text(str(samples))
    view = app.sampling_view
    app.tabview.set("sampling")
    view.refresh_previews()
    assert run_until(app, lambda: len(view._driving_images) == 9 and view.driving_label.winfo_ismapped(), 30)
    settle(app, 0.3)
    screenshot(app, "tab-sampling-vace")
    app.fields["sampling.samples_file"].set_text("")


def test_the_control_and_model_tabs_follow_an_animate_2_model(app, vace_setup, tiny_model, tmp_path):
    """Animate-2 reads <clip>_driving and <clip>_ref: the model tab names those files (not Animate's pose and face
    videos), the control tab names the model and offers animate alone, saying why not replace."""
    from modules.util.demo_animate import make_animate_2_dataset
    data = make_animate_2_dataset(tmp_path / "animate-2", 1, 9, 32)
    vace = {path: app.config_state.get(path) for path in ("model.base_model_name", "data.concepts.0.path")}
    app.fields["model.base_model_name"].set_text(str(tiny_model("wan2.2-animate-2")))
    app.fields["data.concepts.0.path"].set_text(str(data))
    try:
        app._update_variant()
        detail = app.variant_detail.cget("text")
        assert "<name>_driving.mp4" in detail and "<name>_ref.png" in detail and "_pose" not in detail
        view = app.control_view
        view.refresh()
        app.tabview.set("control")
        assert run_until(app, lambda: view.loaded and view.strip.shown_index == 0, 60), view.note.cget("text")
        assert view.sections["animate"][1].cget("text") == "Wan 2.2 Animate-2 14B (animate)"
        assert app.fields["animate.mode"].widget.cget("values") == ["animate"]
        assert view.mode_note.cget("text").startswith("replace does not apply to Wan 2.2 Animate-2 14B")
        assert [companion.role for companion in view.strip.companions] == ["driving", "reference"]
        # the top bar names the model, and its model type follows it (the VACE config said WAN_2_1)
        assert app.fields["model_type"].variable.get() == "WAN_2_2"
        assert app.variant_label.cget("text") == "variant: Wan 2.2 Animate-2 14B (ANIMATE_2_14B)"
        screenshot(app, "tab-control-animate-2")
    finally:
        for path, value in vace.items():
            app.fields[path].set_text(str(value))
        app._update_variant()
        assert app.fields["model_type"].variable.get() == "WAN_2_1"
