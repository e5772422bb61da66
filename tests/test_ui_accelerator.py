"""The sampling tab's accelerator fields and the "accelerated" label of previews made with one (docs/gui.md,
docs/distilled.md). Controllers only: no display."""
import json
from pathlib import Path

import numpy as np

from modules.ui.SampleGallery import gallery_runs
from modules.ui.SamplingController import ACCELERATOR_FIELDS, SamplingController, accelerator_fields
from modules.ui.UIState import UIState
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import write_video

PROMPT = "a red square moving left"


def test_the_accelerator_fields_and_the_low_noise_file_only_for_two_experts(tmp_path):
    assert accelerator_fields(WanVariant.T2V) == ("file", "strength", "steps", "timesteps", "shift")
    assert accelerator_fields(None) == accelerator_fields(WanVariant.I2V) == accelerator_fields(WanVariant.T2V)
    assert accelerator_fields(WanVariant.T2V_A14B) == ACCELERATOR_FIELDS == ("file", "file_2", "strength", "steps",
                                                                             "timesteps", "shift")
    state = UIState({"workspace_dir": str(tmp_path)})
    high, low = tmp_path / "high.safetensors", tmp_path / "low.safetensors"
    for name, text in (("file", str(high)), ("file_2", str(low)), ("strength", "0.8"), ("steps", "6")):
        assert state.set_text(f"sampling.accelerator.{name}", text) is None
    accelerator = state.config().sampling.accelerator
    assert (accelerator.file, accelerator.file_2, accelerator.strength) == (str(high), str(low), 0.8)
    assert accelerator.timestep_list() == [1000, 834, 667, 500, 334, 167]
    state.set_text("sampling.accelerator.steps", "0")
    assert any("sampling.accelerator.steps" in problem for problem in state.validate())


def test_previews_made_with_an_accelerator_are_labelled_so(tmp_path):
    state = UIState({"workspace_dir": str(tmp_path)})
    folder = tmp_path / "samples" / "2026-12-07_06-00-00" / "0-a-red-square"
    folder.mkdir(parents=True)
    frames = np.zeros((5, 16, 16, 3), dtype=np.uint8)
    sample = {"prompt": "a red square", "seed": 1, "width": 16, "height": 16, "frames": 5, "steps": 20,
              "guidance": 5.0}
    accelerated = {**sample, "steps": 4, "guidance": 1.0,
                   "accelerator": {"file": "lightx2v.safetensors", "file_2": "", "strength": 1.0, "steps": 4,
                                   "timesteps": [1000, 750, 500, 250], "shift": 5.0, "guidance": 1.0}}
    for step, settings in ((0, sample), (10, accelerated)):
        write_video(folder / f"{step}-0.mp4", frames, 16)
        (folder / f"{step}-0.json").write_text(json.dumps(settings))
    series = SamplingController(state).previews()
    assert [(video.step, video.label()) for video in series[0].videos] == [(0, ""), (10, "4 steps, accelerated")]
    cells = gallery_runs(tmp_path)[0].cells
    assert "4 steps, accelerated" in cells[("0-a-red-square", 10)].tooltip
    assert "accelerated" not in cells[("0-a-red-square", 0)].tooltip


def test_the_tools_forms_sample_and_compare_with_the_sampling_tabs_accelerator(tiny_model, tmp_path):
    """The tools tab's sample and compare forms run with the accelerator the sampling tab sets: the command line
    carries its files, strength and whole schedule, and the sample it makes is accelerated on that schedule."""
    import sys

    import pytest
    from modules.ui import ToolsController as tools
    from test_accelerator import ROOT, _accelerator_parts, _write, load

    sys.path.insert(0, str(ROOT / "scripts"))
    import compare
    import sample
    base = tiny_model("wan2.1-t2v")
    path = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(load(base).transformer, 3), "lightx2v")
    state = UIState({"workspace_dir": str(tmp_path)})
    assert tools.sampling_accelerator(state) is None   # none set: the forms sample without
    for name, text in (("file", str(path)), ("strength", "0.7"), ("steps", "3"), ("shift", "4")):
        assert state.set_text(f"sampling.accelerator.{name}", text) is None
    accelerator = tools.sampling_accelerator(state)

    def ran_with(args):
        config = args.accelerator_config
        return config.file, config.strength, config.timestep_list(), config.shift
    expected = (str(path), 0.7, [1000, 667, 334], 4.0)
    command = tools.sample_command(str(base), PROMPT, str(tmp_path / "out"), width=32, height=32, frames=5,
                                   steps=20, seed=3, device="cpu", accelerator=accelerator)
    assert ran_with(sample.parse_args(command[1:])) == expected
    assert ran_with(compare.parse_args(tools.compare_command(str(base), [str(path)], [1.0], "o", prompt="p", steps=20,
                                                             accelerator=accelerator)[1:])) == expected

    controller = tools.ToolsController()
    assert controller.run(command) and controller.wait(180)
    code, written = next(payload for kind, payload in controller.poll_events() if kind == "done")
    assert code == 0
    record = json.loads(Path(written[0]).with_suffix(".json").read_text())
    assert record["steps"] == 3 and record["guidance"] == 1.0
    assert record["accelerator"]["timesteps"] == [1000, 667, 334] and record["accelerator"]["shift"] == 4.0

    state.set("sampling.accelerator.timesteps", [250, 500])
    with pytest.raises(ValueError, match="sampling.accelerator"):
        tools.sampling_accelerator(state)
