"""The GUI's parts for control and character models without a display: each dataset item's VACE / Animate
companions as training finds them (modules/ui/ItemCompanions.py, DatasetBrowser), frame-aligned under one frame
index; the model tab's words for the detected variant; the tools tab's sample command with conditions."""
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from modules.ui import DatasetBrowser as browser
from modules.ui import ToolsController as tools
from modules.ui.ItemCompanions import companions_of, control_sections, frames_at, kind_of, viewer_variant
from modules.ui.model_parts import detected_variant, intended_variant
from modules.ui.variant_text import animate_mode_choices, intended_variant_note, variant_description
from modules.ui.UIState import UIState
from modules.util.config.config_io import load_config
from modules.util.demo_animate import make_animate_2_dataset, make_animate_dataset
from modules.util.demo_vace import make_vace_dataset, outline
from modules.util.demo_assets import COLOURS, square_clip
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_io import read_frames

ROOT = Path(__file__).resolve().parent.parent


def config_for(tmp_path, data, *extra):
    return load_config(overrides=[f'data.concepts=[{{"path": "{data}"}}]', f"cache_dir={tmp_path / 'cache'}",
                                  "data.frame_buckets=[1, 5, 9]", "data.resolution=32", "data.aspect_ratios=[1.0]",
                                  "data.dataloader_threads=0", *extra])


@pytest.fixture(scope="module")
def vace_data(tmp_path_factory):
    return make_vace_dataset(tmp_path_factory.mktemp("vace"), clips_per_class=1)


@pytest.fixture(scope="module")
def animate_data(tmp_path_factory):
    return make_animate_dataset(tmp_path_factory.mktemp("animate"), clips_per_class=1)


def by_name(items):
    return {Path(item.path).name: item for item in items}


def test_vace_items_carry_control_mask_and_references_and_a_missing_one_says_so(tmp_path, vace_data):
    data = tmp_path / "data"
    shutil.copytree(vace_data, data)
    shutil.rmtree(data / "red_left_00_control")           # a clip without control trains with a zero control
    (data / "red_right_00_ref.png").rename(data / "red_right_00_ref2.png")   # numbered: still its reference
    items = by_name(browser.browse(config_for(tmp_path, data), 0, WanVariant.VACE))
    assert len(items) == 6 and not any(item.skipped for item in items.values())   # companions are no clips
    assert [c.text for c in items["blue_left_00.mp4"].companions] == [
        "control: blue_left_00_control", "mask: missing (none: optional)", "reference 1: blue_left_00_ref.png"]
    assert items["red_left_00.mp4"].companions[0].text == "control: missing (none: optional)"
    assert items["red_right_00.mp4"].companions[2].text == "reference 1: red_right_00_ref2.png"
    # the same folder for a plain model: no companions to show
    assert all(not item.companions for item in browser.browse(config_for(tmp_path, data), 0, WanVariant.T2V))


def test_one_frame_index_shows_the_same_moment_of_the_clip_and_its_control(vace_data):
    clip = str(vace_data / "green_right_00.mp4")
    companions = companions_of(clip, "vace", None)
    for index in (0, 6):
        shown = frames_at(clip, companions, index)
        target = square_clip(COLOURS["green"], "right", 9, 32, offset=0)[index]
        assert np.array_equal(shown["control"], outline(target[None])[0])   # frame `index` of the control
        assert np.abs(shown["target"].astype(int) - target).mean() < 8       # (the clip is an MP4)
        assert np.array_equal(shown["reference 1"], read_frames(vace_data / "green_right_00_ref.png", [0])[0])
        assert "mask" not in shown   # missing: the panel says so, nothing is read


def test_a_clip_without_control_previews_the_control_derive_computes_from_it(tmp_path, vace_data):
    from modules.model.control_derive import derive_control
    data = tmp_path / "data"
    shutil.copytree(vace_data, data)
    shutil.rmtree(data / "green_right_00_control")
    for derive, kind in (("canny", WanVariant.VACE), ("gray", WanVariant.FUN_CONTROL)):
        items = by_name(browser.browse(config_for(tmp_path, data, f"data.control.derive={derive}"), 0, kind))
        control = items["green_right_00.mp4"].companions[0]
        assert control.text == f"control: derived ({derive}) from the clip's frames"
        assert items["blue_left_00.mp4"].companions[0].text == "control: blue_left_00_control"   # its own wins
        shown = frames_at(control.path, [control], 4)
        # the cache's own function on the same frame (EncodeVACE / EncodeFunControl call derive_control)
        assert np.array_equal(shown["control"], derive_control(shown["target"][None], derive)[0])
        assert shown["control"].std() > 0
    plain = by_name(browser.browse(config_for(tmp_path, data), 0, WanVariant.VACE))   # derive none: missing
    assert plain["green_right_00.mp4"].companions[0].missing
    # Wan-Fun Control's items carry their control alone (the start image is the clip's first frame)
    fun = by_name(browser.browse(config_for(tmp_path, data), 0, WanVariant.FUN_CONTROL_A14B))
    assert [c.text for c in fun["blue_left_00.mp4"].companions] == ["control: blue_left_00_control"]


def test_animate_items_carry_pose_face_reference_and_replace_mode_adds_background_and_mask(tmp_path, animate_data):
    data = tmp_path / "data"
    shutil.copytree(animate_data, data)
    (data / "red_left_00_face.mp4").unlink()
    items = by_name(browser.browse(config_for(tmp_path, data), 0, WanVariant.ANIMATE_14B))
    # the companions (pose, face, bg, mask, ref) are not items of their own: one item per captioned clip
    assert sorted(items) == sorted(f"{p.stem}.mp4" for p in data.glob("*.txt"))
    kept = items["blue_left_00.mp4"]
    assert [c.text for c in kept.companions] == ["pose: blue_left_00_pose.mp4", "face: blue_left_00_face.mp4",
                                                 "reference: blue_left_00_ref.png"]
    broken = items["red_left_00.mp4"]
    assert broken.skipped and "no face video" in broken.skip_reason
    assert broken.companions[1].text == "face: missing (needed)"
    replace = by_name(browser.browse(config_for(tmp_path, data, "animate.mode=replace"), 0, WanVariant.ANIMATE_14B))
    assert [c.role for c in replace["blue_left_00.mp4"].companions] == ["pose", "face", "reference", "background",
                                                                        "mask"]
    shown = frames_at(kept.path, kept.companions, 8)
    assert set(shown) == {"target", "pose", "face", "reference"}
    assert all(isinstance(frame, np.ndarray) for frame in shown.values())


def test_animate_2_items_carry_their_driving_video_and_reference(tmp_path):
    data = make_animate_2_dataset(tmp_path / "data", clips_per_class=1)
    (data / "red_left_00_driving.mp4").unlink()
    items = by_name(browser.browse(config_for(tmp_path, data), 0, WanVariant.ANIMATE_2_14B))
    # the driving videos and references are not items of their own: one item per captioned clip
    assert sorted(items) == sorted(f"{p.stem}.mp4" for p in data.glob("*.txt"))
    kept = items["blue_left_00.mp4"]
    assert [c.text for c in kept.companions] == ["driving: blue_left_00_driving.mp4", "reference: blue_left_00_ref.png"]
    broken = items["red_left_00.mp4"]
    assert broken.skipped and broken.companions[0].text == "driving: missing (needed)"
    shown = frames_at(kept.path, kept.companions, 3)
    assert set(shown) == {"target", "driving", "reference"}
    assert all(isinstance(frame, np.ndarray) for frame in shown.values())


def test_a_companion_that_cannot_be_read_gives_its_reason_in_place_of_a_frame(tmp_path, vace_data):
    clip = tmp_path / "clip.mp4"
    shutil.copy(vace_data / "blue_left_00.mp4", clip)
    (tmp_path / "clip_control.mp4").write_bytes(b"not a video")
    shown = frames_at(str(clip), companions_of(str(clip), "vace", None), 2)
    assert isinstance(shown["target"], np.ndarray) and shown["control"].startswith("cannot be read")


def test_the_model_tab_names_control_and_character_variants(tiny_model, tmp_path):
    assert detected_variant(UIState({"model": {"base_model_name": str(tiny_model("wan2.1-vace"))}})) is \
        WanVariant.VACE
    assert detected_variant(UIState({"model": {"base_model_name": str(tmp_path / "none")}})) is None
    assert variant_description(WanVariant.VACE).startswith("Wan 2.1 VACE: takes a control video; a mask video")
    assert variant_description(WanVariant.VACE_A14B).startswith("Wan 2.2 VACE-Fun A14B, two experts")
    assert variant_description(WanVariant.ANIMATE_14B).startswith("Wan 2.2 Animate 14B: takes a pose video")
    assert variant_description(WanVariant.T2V) == "" and variant_description(None) == ""
    # the viewer looks for companions by the model's variant, else the config's intended variant
    intended = load_config(overrides=["model.intended_variant=VACE", f"model.base_model_name={tmp_path / 'none'}"])
    assert kind_of(viewer_variant(intended)) == "vace"
    assert kind_of(WanVariant.ANIMATE_2_14B) == "animate" and kind_of(WanVariant.I2V) == ""
    assert kind_of(WanVariant.FUN_CONTROL) == kind_of(WanVariant.FUN_CONTROL_A14B) == "fun"
    assert kind_of(WanVariant.FUN_INP) == ""   # the I2V layout: no companions
    assert "control video" in variant_description(WanVariant.FUN_CONTROL_A14B)


def test_the_control_tab_shows_the_control_settings_the_config_has():
    from modules.util.config.DataConfig import DataConfig
    sections = [path for path, _ in control_sections()]
    assert "animate" in sections
    assert ("data.control" in sections) == ("control" in DataConfig.model_fields)


def test_the_control_tab_shows_the_settings_of_the_models_kind_of_control_only():
    assert [path for path, _ in control_sections()] == ["data.control", "animate"]   # no model known yet
    assert control_sections(WanVariant.VACE) == [("data.control", "Wan 2.1 VACE (data.control)")]
    assert control_sections(WanVariant.FUN_CONTROL_A14B) == [("data.control",
                                                              "Wan 2.2 Fun Control A14B (data.control)")]
    assert control_sections(WanVariant.ANIMATE_14B) == [("animate", "Wan 2.2 Animate 14B (animate)")]
    assert control_sections(WanVariant.T2V) == control_sections(WanVariant.FUN_INP) == []


def test_a_mask_video_is_offered_only_where_the_variant_takes_one():
    from modules.ui.SamplingController import variant_editor_fields
    assert WanVariant.FUN_CONTROL_A14B.takes_control_mask and not WanVariant.FUN_CONTROL.takes_control_mask
    assert variant_editor_fields(WanVariant.FUN_CONTROL)[-1] == "control_video"
    assert variant_editor_fields(WanVariant.FUN_CONTROL_A14B)[-2:] == ("control_video", "mask_video")
    assert "mask_video" in variant_editor_fields(WanVariant.VACE)
    assert "mask_video" in variant_editor_fields(WanVariant.ANIMATE_14B)   # Animate's character mask
    assert variant_editor_fields(None) == variant_editor_fields(WanVariant.T2V)
    assert tools.condition_kind(WanVariant.FUN_CONTROL) == "Wan-Fun Control"
    assert "mask-video" not in tools.CONDITIONS["Wan-Fun Control"]
    assert "mask-video" in tools.CONDITIONS[tools.condition_kind(WanVariant.FUN_CONTROL_A14B)]


def test_the_sample_form_gives_sample_py_the_conditions_it_reads():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sample
    vace = tools.sample_command("/m", "a dancer", "/out", conditions={"control-video": "pose.mp4", "mask-video": "",
                                                                     "control-scale": "0.5"},
                                reference_images=["a.png", "b.png"])
    args = sample.parse_args(vace[1:])
    assert (args.control_video, args.mask_video, args.reference_image, args.control_scale) == \
        ("pose.mp4", None, ["a.png", "b.png"], 0.5)
    animate = tools.sample_command("/m", "p", "/out", reference_images=["me.png"], conditions={
        "pose-video": "p.mp4", "face-video": "f.mp4", "background-video": "b.mp4", "mask-video": "m.mp4",
        "mode": "replace", "continuation-frames": "5"})
    args = sample.parse_args(animate[1:])
    assert (args.reference_image, args.pose_video, args.face_video, args.background_video, args.mask_video,
            args.animate_mode, args.continuation_frames) == (["me.png"], "p.mp4", "f.mp4", "b.mp4", "m.mp4",
                                                             "replace", 5)
    assert tools.condition_kind(WanVariant.VACE_A14B) == "VACE" and tools.condition_kind(WanVariant.T2V) == "none"
    assert tools.condition_kind(WanVariant.FUN_CONTROL_A14B) == "Wan-Fun Control A14B"
    fun = tools.sample_command("/m", "p", "/out", image="start.png",
                               conditions={"control-video": "c.mp4", "mask-video": "m.mp4"})
    args = sample.parse_args(fun[1:])
    assert (args.image, args.control_video, args.mask_video) == ("start.png", "c.mp4", "m.mp4")
    assert tools.driving_video({"pose-video": "p.mp4"}) == "p.mp4"


def test_the_sample_list_takes_a_vace_samples_conditions_into_the_samples_file(tmp_path):
    from modules.ui.SamplingController import EDITOR_FIELDS, SamplingController, editor_fields
    from modules.util.sample_definitions import load_sample_definitions
    assert editor_fields("") == EDITOR_FIELDS
    assert editor_fields("vace")[-4:] == ("control_video", "mask_video", "reference_images", "control_scale")
    assert "pose_video" in editor_fields("animate") and "control_video" not in editor_fields("animate")
    controller = SamplingController(UIState({"workspace_dir": str(tmp_path)}))
    controller.add_sample()
    for name, value in (("prompt", "a dancer"), ("control_video", "pose.mp4"),
                        ("reference_images", ["a.png", "b.png"]), ("control_scale", "0.5")):
        assert controller.set_field(0, name, value) is None
    assert controller.set_field(0, "control_scale", "-1") is not None   # refused, as the samples file refuses it
    sample = load_sample_definitions(controller.save_samples())[0]
    assert (sample.control_video, sample.reference_images, sample.control_scale) == ("pose.mp4", ["a.png", "b.png"],
                                                                                     0.5)


def test_a_preview_is_shown_beside_its_samples_control_or_pose_video(tmp_path, vace_data):
    from modules.ui.SamplingController import PreviewSeries, SamplingController
    from modules.util.config.SampleConfig import SampleConfig
    from modules.util.sample_definitions import save_samples_json
    control = vace_data / "blue_left_00_control"
    save_samples_json([SampleConfig(prompt="a", control_video=str(control)),
                       SampleConfig(prompt="b", pose_video=str(tmp_path / "gone.mp4")), SampleConfig(prompt="c")],
                      tmp_path / "samples.json")
    controller = SamplingController(UIState({"sampling": {"samples_file": str(tmp_path / "samples.json")}}))
    assert [controller.driving_video(PreviewSeries(tmp_path, index)) for index in range(4)] == [str(control), "", "",
                                                                                                ""]


def test_the_files_the_model_tab_lists_per_clip_are_the_ones_training_reads(tmp_path):
    """Every variant (base, VACE, Wan-Fun Control, Animate, Animate-2, ...): a user who makes exactly the files the
    model tab names beside a clip gets every companion the data loader's finders look for, and no file of theirs
    goes unread (Animate-2 was told to make _pose and _face videos; it reads _driving)."""
    import re

    from modules.util.config.DataConfig import ConceptConfig
    for variant in WanVariant:
        folder = tmp_path / variant.value
        folder.mkdir()
        clip = folder / "clip.mp4"
        clip.write_bytes(b"")
        # "<name>_driving.mp4", "<name>_ref2.png" (a "<name>_control/" folder is the other form of the control)
        made = set()
        for suffix, extension in re.findall(r"<name>(_[a-z0-9]+)(\.[a-z0-9]+)", variant_description(variant)):
            made.add(folder / f"clip{suffix}{extension}")
            (folder / f"clip{suffix}{extension}").write_bytes(b"")
        mode = "replace" if variant.takes_replacement else "animate"   # every companion the variant can take
        found = companions_of(str(clip), kind_of(variant), None, ConceptConfig(path=str(folder)), mode,
                              variant=variant)
        assert [c.role for c in found if c.missing] == [], variant
        assert {Path(c.path) for c in found} == made, variant
        assert bool(made) == bool(variant.clip_companions), variant


def test_the_companion_roles_of_a_character_model_are_the_ones_its_scan_needs():
    from modules.dataLoader.animate_scan import companion_set
    for variant in (WanVariant.ANIMATE_14B, WanVariant.ANIMATE_2_14B):
        kind = companion_set(variant)
        assert variant.clip_companions == kind.always + kind.replace
        assert ("replace" in variant.animate_modes) == bool(kind.replace)


def test_the_control_tab_names_animate_2_and_offers_only_the_modes_it_trains():
    assert control_sections(WanVariant.ANIMATE_2_14B) == [("animate", "Wan 2.2 Animate-2 14B (animate)")]
    modes, note = animate_mode_choices(WanVariant.ANIMATE_2_14B)
    assert modes == ["animate"] and note.startswith("replace does not apply to Wan 2.2 Animate-2 14B")
    assert animate_mode_choices(WanVariant.ANIMATE_14B) == (["animate", "replace"], "")
    assert animate_mode_choices(None) == (["animate", "replace"], "")   # no model says which yet: both


@pytest.mark.parametrize("intended, detected", [(None, WanVariant.VACE), (WanVariant.T2V, WanVariant.T2V),
                                                (WanVariant.T2V, WanVariant.VACE),
                                                (WanVariant.T2V, WanVariant.ANIMATE_2_14B),
                                                (WanVariant.ANIMATE_14B, WanVariant.ANIMATE_2_14B)])
def test_the_model_tab_says_when_the_intended_variant_is_not_the_models_and_start_would_refuse(intended, detected):
    from modules.trainer.prepare import check_model_variant
    from modules.util.config.config_io import ConfigError
    config = load_config(overrides=[f"model.intended_variant={intended.value if intended else 'null'}"])
    assert intended_variant(UIState({"model": {"intended_variant": intended.value if intended else None}})) is \
        intended
    note = intended_variant_note(intended, detected)
    try:
        check_model_variant(config, detected, "/models/x")
        refused = False
    except ConfigError:
        refused = True
    assert bool(note) == refused   # said on the model tab exactly where Start refuses
    if note:
        assert f"made for {intended.value}" in note and f"the chosen model is {detected.value}" in note
        assert "Start refuses" in note and f"set intended variant to {detected.value}" in note


def test_a_missing_optional_companion_says_it_is_optional_and_a_needed_one_that_it_is_needed():
    from modules.ui.ItemCompanions import Companion
    assert Companion("mask", None).missing_text == "missing (none: optional)"
    assert Companion("driving", None, needed=True).missing_text == "missing (needed)"
    assert Companion("mask", None).text == "mask: missing (none: optional)"
