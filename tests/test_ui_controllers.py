"""Issue 11: the GUI's controllers, tested without a display (they import no toolkit): binding by dotted path with
conversion by the field's type and the CLI's messages, presets, save / reload, the E2V drawing against the data
pipeline's own condition, concept statistics, the preview model, the timestep density, the tools' command lines,
and the trainer's request API (sample / backup / save at the next safe point)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.ui.config_fields import field_spec, section_fields
from modules.ui.ConceptController import ConceptController
from modules.ui.ElementsController import ElementsController
from modules.ui.plot_data import timestep_density
from modules.ui.SamplingController import PreviewPlayer, SamplingController
from modules.ui.TrainController import TrainController
from modules.ui.UIState import UIState
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.OptimizerConfig import TimestepConfig
from modules.util.video_frames import write_video
from test_e2v_config import SEED_001, SEED_002

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "training_presets" / "#demo tiny CPU.json"


def cli_problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=list(overrides))
    return error.value.problems


def test_no_controller_imports_a_toolkit():
    for path in (ROOT / "modules" / "ui").glob("*.py"):
        if path.name.startswith("Ctk") or path.name == "ctk_components.py":
            continue
        text = path.read_text()
        assert "tkinter" not in text and "customtkinter" not in text, path.name


def test_field_kinds_follow_the_pydantic_types():
    assert field_spec("optimizer.learning_rate").kind == "float"
    assert field_spec("lora.rank").kind == "int"
    assert field_spec("gradient_checkpointing").kind == "bool"
    assert field_spec("train_dtype").kind == "choice" and "BFLOAT_16" in field_spec("train_dtype").choices
    assert field_spec("optimizer.scheduler").choices == ("CONSTANT", "CONSTANT_WITH_WARMUP", "COSINE", "LINEAR")
    assert field_spec("data.frame_buckets").kind == "list"
    spec = field_spec("optimizer.clip_grad_norm")
    assert spec.kind == "float" and spec.optional
    assert field_spec("data.concepts.0.path").description == "a folder, or a .jsonl manifest"
    assert field_spec("data.concepts.0.fps").choices == ("model", "source")
    assert field_spec("e2v.datasets.0.elements.1.vae.repeat").kind == "int"
    with pytest.raises(KeyError):
        field_spec("optimizer.no_such_field")


def test_set_text_converts_by_type_and_marks_with_the_cli_message():
    state = UIState()
    marks = {}
    state.bind("optimizer.learning_rate", lambda _t: None, lambda m: marks.__setitem__("lr", m))
    state.bind("data.frame_buckets", lambda _t: None, lambda m: marks.__setitem__("fb", m))
    state.bind("optimizer.clip_grad_norm", lambda _t: None)
    assert state.set_text("optimizer.learning_rate", "2e-4") is None
    assert state.config().optimizer.learning_rate == 2e-4
    state.set_text("data.frame_buckets", "1, 17, 33")
    assert state.config().data.frame_buckets == [1, 17, 33]
    state.set_text("optimizer.clip_grad_norm", "")
    assert state.config().optimizer.clip_grad_norm is None
    # the same words the CLI prints for --config-value of the same text
    for text in ("-1", "abc"):
        message = state.set_text("optimizer.learning_rate", text)
        assert message == cli_problems(f"optimizer.learning_rate={text}")[0]
        assert marks["lr"] == message
    message = state.set_text("data.frame_buckets", "1, 18")
    assert message == cli_problems("data.frame_buckets=[1, 18]")[0] and marks["fb"] == message
    state.set_text("data.frame_buckets", "9")
    assert marks["fb"] is None and state.problems == [state.errors["optimizer.learning_rate"]]
    with pytest.raises(ConfigError):
        state.config()


def test_preset_load_fills_fields_and_save_as_reloads_equal(tmp_path):
    controller = TrainController(last_used=tmp_path / "last.json")
    shown = {}
    controller.state.bind("lora.rank", lambda t: shown.__setitem__("rank", t))
    controller.load(DEMO)
    assert shown["rank"] == "16"   # the demo preset's rank
    assert controller.state.get("data.concepts.0.caption_source") == "sidecar"  # sparse list items filled in
    controller.state.set_text("optimizer.learning_rate", "0.003")
    saved = tmp_path / "saved.json"
    controller.save_as(saved)
    reread = load_config(config_path=str(saved))     # exactly what train.py --config-path reads
    assert reread == controller.state.config()
    assert reread.optimizer.learning_rate == 0.003
    other = TrainController(last_used=tmp_path / "last.json")
    other.load(saved)
    assert other.state.config() == controller.state.config()
    controller.save_last_used()
    restored = TrainController(last_used=tmp_path / "last.json")
    assert restored.restore_last_used() and restored.state.config() == controller.state.config()


def test_preset_tree_and_variant_detection(tiny_model, tmp_path):
    controller = TrainController(last_used=tmp_path / "last.json")
    names = [p.name for p in controller.preset_tree()[""]]
    assert "#demo tiny CPU.json" in names
    controller.state.set("model.base_model_name", str(tiny_model("wan2.1-t2v")))
    assert controller.detect_variant().endswith("(T2V)")
    controller.state.set("model.base_model_name", str(tmp_path))
    assert controller.detect_variant().startswith("not a Wan model")


def test_start_is_refused_with_the_schema_problems(tmp_path):
    controller = TrainController(last_used=tmp_path / "last.json")
    controller.state.set_text("lora.rank", "0")
    problems = controller.start()
    assert problems == cli_problems("lora.rank=0")
    assert not controller.running


def test_timestep_density_comes_from_the_sampler():
    uniform = timestep_density(TimestepConfig(distribution="uniform"), bins=10)
    assert all(0.85 < value < 1.15 for value in uniform)
    shifted = timestep_density(TimestepConfig(distribution="uniform_shift", shift=3.0), bins=10)
    assert shifted[-1] > 3 * shifted[0]
    high = timestep_density(TimestepConfig(distribution="uniform"), bins=10, expert="high", boundary=0.5)
    assert sum(high[:5]) == 0


@pytest.mark.parametrize("combine", ["before", "after"])
@pytest.mark.parametrize("repeats", [(4, 4, 4), (1, 4, 4)], ids=["seed001", "aligned"])
def test_element_drawing_mask_equals_the_pipeline_condition_mask(tiny_model, combine, repeats):
    """The drawing's latent mask is the first `stride` channels of make_e2v_condition (the function the data
    pipeline and the sampler use) with real elements through the tiny model's VAE."""
    from modules.model.e2v_condition import make_e2v_condition
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig

    state = UIState()
    controller = ElementsController(state)
    seed = json.loads(SEED_001)
    assert [e["vae"]["repeat"] for e in seed["datasets"][0]["elements"]] == [4, 4, 4]
    for element, repeat in zip(seed["datasets"][0]["elements"], repeats):
        element["vae"]["repeat"] = repeat
    seed["datasets"][0]["processors"]["vae"]["combine"] = combine
    state.set("e2v.datasets", seed["datasets"])
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-i2v"))))
    generator = torch.Generator().manual_seed(0)
    for present in ([True, True, True], [True, False, True]):
        drawing = controller.drawing(17, present)
        elements = [torch.rand(3, 32, 32, generator=generator) * 2 - 1 if p else None for p in present]
        with torch.no_grad():
            condition = make_e2v_condition(model, elements, list(repeats), 17, combine)
        stride = model.vae_temporal_stride
        expected = condition[:stride, :, 0, 0]
        assert torch.equal(torch.tensor(drawing.latent_mask), expected), (present, drawing.latent_mask)
        assert drawing.slot_of_frame.count(None) == 17 - sum(r for r, p in zip(repeats, present) if p)


def test_elements_import_both_forms_and_export_reads_back(tmp_path):
    state = UIState()
    controller = ElementsController(state)
    for text in (SEED_001, SEED_002):
        source = tmp_path / "seed.json"
        source.write_text(text)
        assert controller.import_file(source) >= 1
        assert controller.problems() == []
        exported = tmp_path / "export.json"
        controller.export_file(exported)
        again = ElementsController(UIState())
        again.import_file(exported)
        assert again.dataset_config() == controller.dataset_config()
    state.set("e2v.datasets.0.elements.1.vae.position", 0)
    assert any(p.startswith("e2v.datasets.0.") for p in controller.problems())


def test_concept_statistics_use_the_loaders_scan(squares_dataset, tmp_path):
    folder = tmp_path / "concept"
    folder.mkdir()
    for path in sorted(squares_dataset.iterdir())[:6]:
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "broken.mp4").write_bytes(b"not a video")
    (folder / "broken.txt").write_text("a broken clip")
    (folder / "uncaptioned.mp4").write_bytes(next(squares_dataset.glob("*.mp4")).read_bytes())
    state = UIState({"data": {"frame_buckets": [9], "resolution": 32, "aspect_ratios": [1.0]}})
    controller = ConceptController(state)
    controller.add(str(folder))
    stats = controller.statistics(0)
    assert stats.error == ""
    assert (stats.clips, stats.images) == (3, 0)
    assert stats.frames_per_bucket == {9: 3} and stats.resolution_buckets == {"32x32": 3}
    reasons = dict(stats.skipped)
    assert any("uncaptioned" in path for path in reasons) and any("broken" in path for path in reasons)
    assert len(stats.thumbnails) == 3 and stats.thumbnails[0][1].shape == (32, 32, 3)


def test_previews_by_prompt_and_step_and_the_player(tmp_path):
    state = UIState({"workspace_dir": str(tmp_path)})
    controller = SamplingController(state)
    folder = tmp_path / "samples" / "0-a-red-square"
    folder.mkdir(parents=True)
    frames = np.zeros((5, 16, 16, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.arange(5)[:, None, None] * 50
    for step in (10, 2):
        write_video(folder / f"{step}-0.mp4", frames, 16)
    (folder / "10-0.png").write_bytes(b"")
    series = controller.previews()
    assert [v.step for v in series[0].videos] == [2, 10] and series[0].newest.step == 10
    # a gallery cell opens in the player as its series and step (not the newest one's labels around it)
    runs, found, index = controller.locate(folder / "2-0.mp4")
    assert found.folder == folder and index == 0 and [s.name for s in runs] == ["0-a-red-square"]
    assert controller.locate(tmp_path / "compare" / "grid.mp4") is None
    player = PreviewPlayer()
    player.open(series[0].newest.path)
    assert len(player.frames) == 5 and player.fps == pytest.approx(16)
    first = player.frame.copy()
    assert player.tick() and not np.array_equal(player.frame, first)
    for _ in range(4):
        player.tick()
    assert player.index == 0  # looped
    player.loop = False
    for _ in range(6):
        player.tick()
    assert player.index == 4 and not player.playing


def test_sample_list_editor_writes_the_samples_file(tmp_path):
    state = UIState({"workspace_dir": str(tmp_path)})
    controller = SamplingController(state)
    controller.load_samples()
    index = controller.add_sample()
    assert controller.set_field(index, "prompt", "a red square") is None
    assert "frames" in controller.set_field(index, "frames", 0)
    path = controller.save_samples()
    assert state.get("sampling.samples_file") == str(path)
    from modules.util.sample_definitions import load_sample_definitions
    assert [s.prompt for s in load_sample_definitions(path)] == ["a red square"]


def test_tool_command_lines_parse_with_the_scripts_own_parsers():
    sys.path.insert(0, str(ROOT / "scripts"))
    import convert_model
    import sample
    from modules.ui import ToolsController as tools

    args = sample.parse_args(tools.sample_command("base", "a prompt", "out", loras=["l.safetensors:0.5"], width=64,
                                                  frames=9, guidance=3.0, seed=7,
                                                  elements={"person": "p.png"})[1:])
    assert (args.prompt, args.lora, args.width, args.frames, args.guidance, args.seed, args.elements) == \
        (["a prompt"], ["l.safetensors:0.5"], 64, 9, 3.0, 7, {"person": "p.png"})
    args = convert_model.parse_args(tools.merge_lora_command("base", ["a:0.8", "b"], "DIFFUSERS", "out")[1:])
    assert (args.merge_lora, args.base_model_name, args.output_model_format) == (["a:0.8", "b"], "base", "DIFFUSERS")
    args = convert_model.parse_args(tools.convert_lora_command("l", "KOHYA_LORA", "o", "BFLOAT_16")[1:])
    assert (args.training_method, args.output_model_format, args.output_dtype) == ("LORA", "KOHYA_LORA",
                                                                                    "BFLOAT_16")
    import compare
    # the compare form's size: without one a prompt is drawn at 832 x 480 x 81 (hours on a CPU for the demo)
    args = compare.parse_args(tools.compare_command("base", ["l.safetensors"], [0.5, 1.0], "out", prompt="p",
                                                    width=32, height=32, frames=9)[1:])
    assert (args.width, args.height, args.frames, args.steps, args.strengths) == (32, 32, 9, None, [0.5, 1.0])


def test_a_running_tool_is_stopped(tiny_model, tmp_path):
    """A tool's child process ends on Stop (and when the window closes), not when it is done."""
    from modules.ui import ToolsController as tools
    controller = tools.ToolsController()
    assert not controller.stop()     # nothing runs
    assert controller.run(tools.sample_command(str(tiny_model("wan2.1-t2v")), "a red square", str(tmp_path),
                                               width=832, height=480, frames=81, steps=50))
    deadline = __import__("time").monotonic() + 60
    while controller._process is None and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.05)
    assert controller.stop() and controller.wait(30)
    code, written = [payload for kind, payload in controller.poll_events() if kind == "done"][0]
    assert code != 0 and not list(tmp_path.glob("*.mp4"))


def test_requests_are_served_at_the_next_safe_point(tiny_model, squares_dataset, tmp_path):
    from modules.trainer.backup_io import all_backups, read_backup
    from modules.trainer.GenericTrainer import GenericTrainer
    from modules.trainer.prepare import prepare_config
    from modules.util.sample_definitions import save_samples_json
    from modules.util.config.SampleConfig import SampleConfig

    samples = tmp_path / "samples.json"
    save_samples_json([SampleConfig(prompt="a red square moving left", width=32, height=32, frames=9, steps=2)],
                      samples)
    config = load_config(str(DEMO), overrides=[
        "demo_assets=false", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
        f'data.concepts=[{{"path": "{squares_dataset}"}}]', f"workspace_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}", f"output.destination={tmp_path / 'out.safetensors'}", "max_steps=3",
        "tensorboard=false", f"sampling.samples_file={samples}", "sampling.every_n_steps=0",
        "sampling.sample_before_training=false", "backup.every_n_steps=0"])
    seen = []

    def on_update(info):
        seen.append(info["step"])
        if info["step"] == 1:
            for action in trainer.REQUESTS:
                trainer.request(action)

    trainer = GenericTrainer(config, on_update=on_update, e2v_datasets=prepare_config(config))
    with pytest.raises(ValueError):
        trainer.request("explode")
    trainer.train()
    assert seen == [1, 2, 3]
    # the requested backup at step 1, and backup.backup_before_save's before the final save
    assert [b.name for b in all_backups(tmp_path / "run" / "backup")] == ["step-00000001", "step-00000003"]
    assert read_backup(all_backups(tmp_path / "run" / "backup")[0])["progress"].global_step == 1
    assert (tmp_path / "run" / "save" / "step-00000001.safetensors").is_file()
    assert [p.name for p in trainer.samples_dir.glob("*/*.mp4")] == ["1-0.mp4"]  # this run's previews


def test_an_ended_run_frees_its_model_and_the_next_queue_job_reports_its_own_plan(tiny_model, squares_dataset,
                                                                                   tmp_path):
    """The controller kept the last run's trainer: its model and optimizer stayed in memory while the window idled,
    and the first queue job after a run read that trainer's plan ("200 steps" for a 40-step job) and Stop went to
    it instead of the job."""
    import gc

    from modules.trainer.GenericTrainer import GenericTrainer
    from modules.util.config.config_io import config_to_dict
    config = load_config(str(DEMO), overrides=[
        "demo_assets=false", f"model.base_model_name={tiny_model('wan2.1-t2v')}",
        f'data.concepts=[{{"path": "{squares_dataset}"}}]', f"workspace_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}", f"output.destination={tmp_path / 'out.safetensors'}", "max_steps=2",
        "tensorboard=false", "sampling.samples_file=", "sampling.sample_before_training=false",
        "backup.every_n_steps=0", "backup.backup_before_save=false"])
    state = UIState(config_to_dict(config))
    controller = TrainController(state, last_used=tmp_path / "last.json", queue_path=tmp_path / "queue.json")
    # trainers other tests keep (session fixtures of the multi-GPU tests hold theirs) are not this run's
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, GenericTrainer)}
    assert controller.start() == [] and controller.wait(300)
    events = controller.poll_events()
    assert [payload["total_steps"] for kind, payload in events if kind == "plan"] == [2], events[-3:]
    # the whole run plan the terminal prints, for the window's log pane and end panel
    plans = [payload for kind, payload in events if kind == "run_plan"]
    assert len(plans) == 1 and plans[0] == controller.run.plan_text
    assert plans[0].startswith("run plan:") and "  steps: 2 optimizer steps" in plans[0] and "  optimizer: " in plans[0]
    gc.collect()
    assert controller.trainer is None and not [o for o in gc.get_objects()
                                               if isinstance(o, GenericTrainer) and id(o) not in before]
    assert controller.run.encode_calls["EncodeText"] == 6   # what the run encoded is still told
    state.set("max_steps", 3)
    state.set("output.destination", str(tmp_path / "job.safetensors"))
    assert controller.add_to_queue() == [] and controller.wait_added(120)
    assert controller.start_queue() == [] and controller.wait(300)
    events = controller.poll_events()
    assert [payload["total_steps"] for kind, payload in events if kind == "plan"] == [3], events[-3:]
    assert (tmp_path / "job.safetensors").is_file() and controller.trainer is None


def test_field_listing_covers_every_section():
    names = {spec.name for spec in section_fields("")}
    assert {"optimizer", "lora", "data", "e2v", "epochs"} <= names


def test_without_a_file_manager_the_folder_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    """Before: "[Errno 2] No such file or directory: 'xdg-open'" where the user wanted to find the folder."""
    from modules.ui.desktop import open_folder
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))
    monkeypatch.chdir(tmp_path)
    problem = open_folder("workspace/output")
    assert problem is not None and "Errno" not in problem
    assert problem.endswith(f"\n\n{tmp_path / 'workspace' / 'output'}") and "is not installed" in problem


def test_a_validation_point_is_inside_the_loss_axis_as_it_is_added():
    """A validation loss above every training loss widens the axis in the drawing that adds it: its y is inside
    the plot, at the top, not above it; a NaN point is left out rather than taking the range with it."""
    from modules.ui.plot_data import loss_axis, plot_area, y_of
    left, top, right, bottom = plot_area(1180, 300)   # a short tab (the end-of-run panel is shown)
    assert bottom <= 300 - 30 and right <= 1180 - 60   # the step labels and the lr labels fit the canvas
    training = {"loss": [(s, 0.3 - 0.001 * s) for s in range(1, 101)]}
    training["smoothed"] = [(s, v + 0.01) for s, v in training["loss"]]
    with_validation = dict(training, validation=[(100, 0.9)])
    axis = loss_axis(with_validation)
    for name, points in with_validation.items():
        for _, value in points:
            assert top <= y_of(value, axis, top, bottom) <= bottom, (name, value)
    assert y_of(0.9, axis, top, bottom) == pytest.approx(top)
    assert loss_axis(dict(training, validation=[(50, float("nan"))])) == loss_axis(training)
    low, high = loss_axis({"validation": [(10, 0.5)]})   # one point: a range around it, not a zero span
    assert low < 0.5 < high


def test_shift_and_the_wheel_scroll_sideways():
    from modules.ui.scrolling import SHIFT, wheel_scroll
    assert wheel_scroll(5, 0, 0, "linux") == ("y", 1) and wheel_scroll(4, 0, 0, "linux") == ("y", -1)
    assert wheel_scroll(5, 0, SHIFT, "linux") == ("x", 1) and wheel_scroll(4, 0, SHIFT | 0x4, "linux") == ("x", -1)
    assert wheel_scroll(0, 120, SHIFT, "win32") == ("x", -1) and wheel_scroll(0, -240, 0, "win32") == ("y", 2)
    assert wheel_scroll(0, 2, SHIFT, "darwin") == ("x", -2)
    assert wheel_scroll(1, 0, 0, "linux") is None
