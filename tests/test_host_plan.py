"""Host RAM planned per phase (modules/planner/host_plan.py): the plan against a real run's measured memory, and
`--ram-gib` (and the memory available) refusing a run before any model loads."""
import json

from modules.planner.host_plan import GIB, MIB, pinned_bytes, plan_host
from tests.script_loader import load_script

train_script = load_script("train")

# Per phase: within 15 % of the measured growth, plus 48 MiB for what the plan does not count (the CPU kernels'
# weight caches, the sampler's video writer, the allocator's per-thread arenas). The model's transformer alone is
# 134 MiB in bfloat16: a part counted in a phase where it is not (or missed where it is) exceeds it.
TOLERANCE, SLACK = 0.15, 48 * MIB


def test_every_phase_predicts_the_memory_a_real_run_measures(tmp_path):
    """A real CPU run (loader, caching passes, two training steps with previews, a backup, the final save) of a
    model of a few hundred MB, its anonymous RSS sampled per phase, in a subprocess of its own: other tests' memory
    is not in its RSS, and glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so freed tensors leave RSS as
    the plan counts them."""
    from modules.benchmark.ram_bench import run_measured
    rows = run_measured("small", tmp_path, tmp_path / "rows.json")
    phases = {row["phase"] for row in rows}
    assert {"load", "caching: VAE / image encoding", "caching: text encoding", "training step", "preview",
            "backup", "final save"} <= phases, phases
    wrong = [row for row in rows if abs(row["predicted"] - row["measured"]) > TOLERANCE * row["measured"] + SLACK]
    assert not wrong, json.dumps(wrong, indent=1)
    by = {row["phase"]: row for row in rows}
    assert by["load"]["measured"] > 100 * MIB   # the model is large enough for the tolerance to mean something


def test_the_14b_preset_plan_names_its_parts_per_phase():
    """The 24 GB 14B preset (no weights: the released configs): the text encoder is released before the VAE pass,
    the swapped blocks are pinned at their own size (one arena), and the text encoder is gone in training."""
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    config = load_config(None, resolve_preset("wan 2.1 14B LoRA 24GB"), [])
    plan = plan_host(config, cuda=True)
    vae_pass = plan.phases["caching: VAE / image encoding"]
    assert 10 * GIB < plan.phases["load"]["text encoder"] < 11 * GIB   # UMT5-XXL in bfloat16, its embedding once
    assert "text encoder" not in vae_pass     # released after the text pass, which runs first
    assert 13 * GIB < vae_pass["transformer"] < 14 * GIB            # 14B in float8
    step = plan.phases["training step"]
    assert "text encoder" not in step and "transformer" not in step
    # 34 of 40 blocks, not rounded up per tensor (the blocks are most but not all of the transformer's weights)
    assert 0.8 * 34 / 40 * vae_pass["transformer"] < step["swapped blocks (pinned)"] < 34 / 40 * vae_pass["transformer"]
    assert plan.line().startswith(f"predicted host RAM peak: {plan.peak_gib:.1f} GiB (phase ")


def test_pinned_sizes_round_to_powers_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 1000, 1024, 1025, 26_214_400)] == [0, 1, 1024, 1024, 2048, 33_554_432]


def _train_args(tmp_path, model, *values):
    argv = ["--config-value", f"model.base_model_name={model}", "--config-value", f"workspace_dir={tmp_path / 'ws'}",
            "--config-value", f"cache_dir={tmp_path / 'cache'}", "--config-value", "device=cpu",
            "--config-value", f"output.destination={tmp_path / 'out.safetensors'}",
            "--config-value", 'data.concepts=[{"path": "' + str(tmp_path / "clips") + '"}]',
            "--config-value", "data.frame_buckets=[9]", "--config-value", "data.resolution=32"]
    for value in values:
        argv += ["--config-value", value]
    return argv


def _clips(tmp_path):
    from modules.util.demo_assets import make_t2v_dataset
    return make_t2v_dataset(tmp_path / "clips")


def test_a_run_above_ram_gib_is_refused_before_any_model_loads(tiny_model, tmp_path, capsys, no_model_loads):
    _clips(tmp_path)
    code = train_script.main(_train_args(tmp_path, tiny_model("wan2.1-t2v")) + ["--ram-gib", "0.1"])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "predicted host RAM peak" in error and "in phase " in error and "--ram-gib 0.1" in error, error
    assert "process (interpreter, libraries)" in error   # the phase's largest parts are named
    assert "nothing fits" in error, error
    assert not (tmp_path / "out.safetensors").exists()


def test_a_run_above_the_available_memory_is_refused_naming_the_cut_that_fits(tiny_model, tmp_path, capsys,
                                                                               no_model_loads, monkeypatch):
    """Without --ram-gib the budget is the memory available at start: a host whose free memory is between the
    run's plan and the plan with fewer decoding threads is refused with that setting."""
    import psutil
    from modules.util.config.config_io import load_config
    from modules.planner.host_fit import apply_values
    _clips(tmp_path)
    model = tiny_model("wan2.1-t2v")
    config = load_config(overrides=_train_args(tmp_path, model, "data.dataloader_threads=8",
                                               "data.resolution=512")[1::2])
    as_set = plan_host(config, cuda=False).peak_bytes
    cut = plan_host(apply_values(config, {"data.dataloader_threads": 1}), cuda=False).peak_bytes
    assert cut < as_set
    own = psutil.Process().memory_info().rss
    available = (as_set + cut) // 2 - own

    class Memory:
        pass
    memory = Memory()
    memory.available = available
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    code = train_script.main(_train_args(tmp_path, model, "data.dataloader_threads=8", "data.resolution=512"))
    error = capsys.readouterr().err
    assert code == 2, error
    assert "(available at start)" in error and "--config-value data.dataloader_threads=1" in error, error


def test_plan_with_ram_gib_fits_or_names_the_phase(tiny_model, capsys):
    """`benchmark plan --ram-gib`: a size that holds the run fits (exit 0), a size under the process alone is
    refused (exit 2) naming the phase."""
    from modules.planner.plan_command import plan_and_print
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig(model={"base_model_name": str(tiny_model("wan2.1-t2v"))}, device="cpu",
                         data={"resolution": 32, "frame_buckets": [9]})
    lines = []
    assert plan_and_print(config, None, out=lines.append, caching=False, ram_gib=16) == 0
    assert any(line.startswith("predicted host RAM peak: ") for line in lines)
    assert any("host RAM: fits 16 GiB" in line for line in lines), lines
    lines.clear()
    assert plan_and_print(config, None, out=lines.append, caching=False, ram_gib=0.2) == 2
    assert any("does not fit 0.2 GiB" in line and "in phase" in line for line in lines), lines


def test_ram_gib_joins_the_device_fit(tiny_model):
    """With both bounds the fit takes only settings that fit the host too: a host that cannot hold block swap's
    pinned blocks makes the fit pass over the swapped settings and say the host bound decided."""
    from modules.planner.memory_plan import fit
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig(model={"base_model_name": str(tiny_model("wan2.1-t2v"))}, train_dtype="BFLOAT_16",
                         data={"resolution": 64, "frame_buckets": [9]}, lora={"rank": 4, "alpha": 4.0})
    roomy = fit(config, 2.0, objective="least", ram_gib=64)
    assert roomy.settings is not None and roomy.settings.block_swap > 0 and roomy.bound == "device"
    assert "fits 64 GiB of host RAM too (bound: device)" in roomy.text()
    host = plan_host(roomy.settings.apply(config), roomy.prediction, cuda=True)
    tight = fit(config, 2.0, objective="least", ram_gib=(host.peak_bytes - 1) / GIB)
    assert tight.settings is None and tight.bound == "host RAM"
    assert "(bound: host RAM)" in tight.text() and "in phase" in tight.text(), tight.text()


def test_the_guard_keeps_each_presets_host_peak_and_names_a_regression():
    """docs/memory_presets.json keeps each planned preset's host RAM peak (the guard test compares every preset's
    with it, as its device peak); more decoded clips in flight while caching is a host regression, named."""
    from modules.planner import preset_guard
    from modules.util.config.config_io import load_config
    stored = preset_guard.load_stored()["guard"]
    assert all("host_bytes" in numbers for numbers in stored.values() if "peak_bytes" in numbers)
    name = "wan 2.1 1.3B LoRA 16GB"
    config = load_config(preset_path=str(preset_guard.shipped_presets()[name]))
    assert preset_guard.guard_host_bytes(config) == stored[name]["host_bytes"]
    # 128 clips in flight (about 35 GiB): the VAE pass, with the text encoder released before it, above the load
    config.data.dataloader_threads = 64
    planted = {name: {**stored[name], "host_bytes": preset_guard.guard_host_bytes(config)}}
    messages = preset_guard.regressions(stored, planted)
    assert len(messages) == 1 and messages[0].startswith(f"{name}: predicted host RAM peak grew "), messages


def test_the_memory_plan_line_and_fit_to_my_card_show_the_host_peak(tiny_model):
    """The GUI's memory line and its "fit to my card" answer say the host RAM peak and its phase (the plan of the
    config shown, and of the switches the fit chose: block swap's pinned blocks are in host memory)."""
    from modules.planner.memory_plan import predict
    from modules.ui.MemoryPlanController import MemoryPlanController
    from modules.ui.UIState import UIState
    state = UIState({"model": {"base_model_name": str(tiny_model("wan2.1-t2v"))}, "gradient_checkpointing": True,
                     "device": "cpu", "data": {"resolution": 64, "frame_buckets": [9]},
                     "optimizer": {"optimizer": "ADAMW"}})
    controller = MemoryPlanController(state)
    assert controller.predict(4.0)
    controller.wait(300)
    text = controller.poll()
    config = state.config()
    host = plan_host(config, predict(config), cuda=False)
    assert text.endswith(f"; host RAM {host.peak_gib:.1f} GiB predicted (phase {host.peak_phase})"), text
    assert controller.fit(4.0, "least")
    controller.wait(300)
    text = controller.poll()
    assert "(least memory)" in text and "; host RAM " in text and "GiB predicted (phase " in text, text


def _file_backed_share(module) -> float:
    """The share of `module`'s parameter bytes whose storage lies in a mapping of a file (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5].startswith("/"):
                begin, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((begin, end))
    total = mapped = 0
    for parameter in module.parameters():
        size = parameter.numel() * parameter.element_size()
        pointer = parameter.untyped_storage().data_ptr()
        total += size
        mapped += size if any(begin <= pointer < end for begin, end in ranges) else 0
    return mapped / total


def test_parts_read_in_their_files_dtype_are_planned_as_the_files_mapping(tiny_model):
    """A part loaded in its file's own dtype stays a view of the file's memory mapping (file-backed pages, not
    anonymous memory) and the plan says so; a part cast as read is a copy. The tiny folder's files are float32: the
    transformer read in bfloat16 is cast, the VAE and text encoder read in float32 are mapped. The loader's real
    weights decide, phase by phase as they stay: on a CPU every phase, on CUDA only until the part's device pass."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig(model={"base_model_name": str(tiny_model("wan2.1-t2v")),
                                "transformer": {"weight_dtype": "BFLOAT_16"}, "text_encoder": {"weight_dtype": "FLOAT_32"},
                                "vae": {"weight_dtype": "FLOAT_32"}},
                         device="cpu", data={"resolution": 32, "frame_buckets": [9]})
    model = WanBaseModelLoader().load(config.model)
    loaded = {"transformer": model.transformer, "text encoder": model.text_encoder, "VAE": model.vae}
    really_mapped = {name for name, part in loaded.items() if _file_backed_share(part) > 0.5}
    assert really_mapped == {"text encoder", "VAE"}, {n: _file_backed_share(p) for n, p in loaded.items()}
    plan = plan_host(config, cuda=False)
    for phase in ("load", "caching: VAE / image encoding", "training step", "final save"):
        held = set(plan.phases[phase]) & set(loaded)
        assert plan.mapped[phase] == held & really_mapped, (phase, plan.mapped[phase])
    assert plan.anonymous_growth("load") == plan.growth("load") - plan.phases["load"]["VAE"] - \
        plan.phases["load"]["text encoder"]
    on_cuda = plan_host(config, cuda=True)
    assert on_cuda.mapped["load"] == {"text encoder", "VAE"}
    assert "VAE" not in on_cuda.mapped["training step"]   # moved to the device for the VAE pass and back: a copy
    cast = config.model_copy(deep=True)
    cast.model.vae.weight_dtype = cast.model.transformer.weight_dtype   # bfloat16 from a float32 file
    assert plan_host(cast, cuda=False).mapped["load"] == {"text encoder"}


def _caching_in_process(folder, config):
    """caching_plan.plan_caching_of(config) (patched itself, so not called by name), leaving a file named after
    the process that ran it."""
    import os

    from modules.planner.caching_plan import plan_caching
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    (folder / str(os.getpid())).touch()
    arch = resolve_architecture(config)
    return plan_caching(config, arch, largest_shape(config, arch))


def test_the_caching_plan_runs_beside_the_step_traces_and_prints_the_same(tiny_model, tmp_path, monkeypatch):
    """`benchmark plan` plans the caching pass in a trace worker while the step is traced: what it prints is what
    one process planning both prints, and the caching line is plan_caching's."""
    import functools
    import os
    import re
    from collections import OrderedDict

    from modules.planner import caching_plan, composed_trace
    from modules.planner.plan_command import plan_and_print
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    from modules.planner.Prediction import GIB, allowance_bytes
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig(model={"base_model_name": str(tiny_model("wan2.1-t2v"))}, device="cpu",
                         data={"resolution": 32, "frame_buckets": [9]})
    printed = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("WAN_PLANNER_WORKERS", workers)
        monkeypatch.setattr(composed_trace, "_traces", OrderedDict())
        folder = tmp_path / workers
        folder.mkdir()
        monkeypatch.setattr(caching_plan, "plan_caching_of", functools.partial(_caching_in_process, folder))
        lines = []
        assert plan_and_print(config, None, out=lines.append) == 0
        printed[workers] = [re.sub(r"planned in +[\d.]+ s", "planned in", line) for line in lines]
        ran_in = [p.name for p in folder.iterdir()]
        assert len(ran_in) == 1 and (ran_in[0] == str(os.getpid())) == (workers == "1"), (workers, ran_in)
    assert printed["1"] == printed["2"]
    arch = resolve_architecture(config)
    plan = caching_plan.plan_caching(config, arch, largest_shape(config, arch))
    text = (plan.text_encoder_bytes + allowance_bytes(plan.text_encoder_bytes)) / GIB
    assert [line for line in printed["2"] if line.startswith("caching (")][0].endswith(f"text encoder {text:.1f} GiB")
