"""The GUI's Animate-2 parts without a display: the tools tab's sample form gives sample.py the driving video and
the character, the sample list offers Animate-2's columns (a driving video, not Animate's pose and face videos) and
writes them to the samples file, and a preview plays beside its sample's driving video."""
from modules.ui import ToolsController as tools
from modules.ui.SamplingController import PreviewSeries, SamplingController, variant_editor_fields
from modules.ui.UIState import UIState
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.sample_definitions import load_sample_definitions, save_samples_json


def test_the_sample_form_gives_an_animate_2_model_its_driving_video():
    assert tools.condition_kind(WanVariant.ANIMATE_2_14B) == "Animate-2"
    assert tools.condition_kind(WanVariant.ANIMATE_14B) == "Animate"
    assert "pose-video" not in tools.CONDITIONS["Animate-2"] and "driving-video" not in tools.CONDITIONS["Animate"]
    command = tools.sample_command("/m", "a dancer", "/out", reference_images=["me.png"],
                                   conditions={"driving-video": "dance.mp4", "continuation-frames": "5"})
    assert command[command.index("--driving-video") + 1] == "dance.mp4"
    assert command[command.index("--reference-image") + 1] == "me.png"
    assert command[command.index("--continuation-frames") + 1] == "5"
    assert tools.driving_video({"driving-video": "dance.mp4"}) == "dance.mp4"


def test_the_sample_list_offers_and_saves_animate_2_columns(tmp_path):
    columns = variant_editor_fields(WanVariant.ANIMATE_2_14B)
    assert columns[-2:] == ("reference_image", "driving_video")
    assert "pose_video" not in columns and "face_video" not in columns
    assert "driving_video" not in variant_editor_fields(WanVariant.ANIMATE_14B)
    controller = SamplingController(UIState({"workspace_dir": str(tmp_path)}))
    controller.add_sample()
    for name, value in (("prompt", "a dancer"), ("reference_image", "me.png"), ("driving_video", "dance.mp4")):
        assert controller.set_field(0, name, value) is None
    sample = load_sample_definitions(controller.save_samples())[0]
    assert (sample.reference_image, sample.driving_video) == ("me.png", "dance.mp4")


def test_a_preview_plays_beside_its_samples_driving_video(tmp_path):
    driving = tmp_path / "dance.mp4"
    driving.write_bytes(b"")
    save_samples_json([SampleConfig(prompt="a", driving_video=str(driving)),
                       SampleConfig(prompt="b", driving_video=str(tmp_path / "gone.mp4"))], tmp_path / "samples.json")
    controller = SamplingController(UIState({"sampling": {"samples_file": str(tmp_path / "samples.json")}}))
    assert [controller.driving_video(PreviewSeries(tmp_path, index)) for index in range(2)] == [str(driving), ""]


def test_the_top_bar_names_an_animate_2_model_and_its_model_type_follows_it(tiny_model, tmp_path):
    """The top bar's model type and variant follow the chosen model: an Animate-2 model chosen under a Wan 2.1
    config (the demo preset's) is named as such, and model_type becomes its WAN_2_2 (Start refuses a mismatch)."""
    from modules.ui.TrainController import TrainController
    controller = TrainController(UIState({"model_type": "WAN_2_1", "workspace_dir": str(tmp_path)}),
                                 last_used=tmp_path / "last.json")
    controller.state.set("model.base_model_name", str(tiny_model("wan2.2-animate-2")))
    assert controller.detect_variant() == "Wan 2.2 Animate-2 14B (ANIMATE_2_14B)"
    assert controller.follow_model_type() == ("model type set to WAN_2_2 (was WAN_2_1): the chosen model is "
                                              "Wan 2.2 Animate-2 14B")
    assert controller.state.get("model_type") == "WAN_2_2" and controller.state.config().model_type.value == "WAN_2_2"
    assert controller.follow_model_type() == ""   # it fits now: nothing to say
    controller.state.set("model.base_model_name", str(tmp_path / "not-there"))
    assert controller.follow_model_type() == "" and controller.state.get("model_type") == "WAN_2_2"
