"""A plan composed from traces of the transformer cut to a few blocks (modules/planner/composed_trace.py) equals the
plan of the whole transformer traced (`exact`), peak and every part, for every shipped preset family with its own
switches (block swap, activation offload, checkpointing, fp8, LoRA and fine-tune, two experts, VACE); Animate-2
and the variants whose blocks repeat every 5th are traced whole, and say so.
In CI the transformers are cut to 18-36 blocks (24 of 30 swapped where the preset swaps) of their real width at a
tiny shape (the exact trace of 40 real-size blocks takes minutes); WAN_PLANNER_FULL=1 compares the real-size plans
the docs quote."""
import dataclasses
import os

import pytest

from modules.planner.composed_trace import _trace_numbers as TRACE_NUMBERS
from modules.planner.composed_trace import layouts_of
from modules.planner.memory_plan import predict
from modules.planner.plan_shapes import PlanShape, largest_shape, resolve_architecture

SHAPE = PlanShape(batch_size=1, frames=9, height=64, width=64)
COMPARED = ("traced_bytes", "parts", "peak_phase", "host_pinned_bytes", "parameters", "trainable_parameters",
            "features", "preview_bytes")

# preset -> (blocks, block swap) of the cut transformer: the preset's own switches, its swap scaled
FAMILIES = {
    "wan 2.1 1.3B LoRA 24GB": (18, 0),          # LoRA, every block checkpointed, per-token chunks
    "wan 2.1 1.3B fine-tune": (18, 0),          # fine-tune, float32 weights
    "wan 2.1 1.3B LoRA 16GB": (36, 3),          # a few blocks swapped
    "wan 2.1 14B LoRA 24GB": (30, 24),          # fp8, block swap, activation offload
    "wan 2.1 I2V 14B LoRA": (18, 0),            # image embeddings
    "wan 2.1 FLF2V 14B LoRA": (18, 0),
    "wan 2.1 Fun-Control 14B LoRA 24GB": (30, 24),
    "wan 2.1 VACE 1.3B LoRA 16GB": (36, 0),     # a VACE block beside every 2nd block
    "wan 2.2 T2V-A14B LoRA high": (30, 24),     # two experts, the high one trains
    "wan 2.2 I2V-A14B LoRA low": (30, 24),
    "wan 2.2 TI2V-5B LoRA": (18, 0),            # a timestep per token
}


def preset_config(name: str, *overrides: str):
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    return load_config(preset_path=resolve_preset(name), overrides=overrides)


def cut(config, blocks: int, swap: int):
    arch = resolve_architecture(config)
    fields = {"num_layers": blocks}
    if arch.transformer.get("vace_layers"):
        every = arch.transformer["vace_layers"][1]
        fields["vace_layers"] = list(range(0, blocks, every))
    config = config.model_copy(deep=True)
    config.performance.block_swap = swap
    return config, dataclasses.replace(arch, transformer={**arch.transformer, **fields})


def assert_same(composed, exact):
    assert composed.how.startswith("composed from"), composed.how
    assert exact.how.startswith("exact"), exact.how
    for field in COMPARED:
        assert getattr(composed, field) == getattr(exact, field), (field, composed.how)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_composed_plan_equals_the_whole_transformer_traced(name):
    config, arch = cut(preset_config(name), *FAMILIES[name])
    assert_same(predict(config, SHAPE, arch), predict(config, SHAPE, arch, exact=True))


@pytest.mark.parametrize("name,blocks,swap", [
    ("wan 2.1 1.3B LoRA 24GB", 30, 29),    # one block before the swapped run: the fit's first guesses
    ("wan 2.1 1.3B LoRA 24GB", 48, 4),     # both runs extrapolated
    ("wan 2.1 14B LoRA 24GB", 30, 27),     # fp8, activation offload, three blocks before the swapped run
])
def test_checkpointing_every_2nd_block_with_swapped_blocks_composes_exactly(name, blocks, swap):
    """The swapped blocks are all checkpointed, so they repeat every block whatever the checkpointing of the blocks
    before them: a fit's settings with checkpointing every 2nd block and most blocks swapped compose from a few
    blocks (traced whole before: the cut transformers held two thirds of the blocks)."""
    config, arch = cut(preset_config(name, "performance.checkpoint_every=2", "performance.activation_offload=true"),
                       blocks, swap)
    assert_same(predict(config, SHAPE, arch), predict(config, SHAPE, arch, exact=True))


def test_animate_2_is_traced_whole_and_the_plan_says_why():
    """Animate-2 runs its blocks twice a step (the extract pass, then the cached pass): composed from cut
    transformers its peak came out 9 % above the exact one (30 blocks, 24 swapped), so it is traced whole."""
    config, arch = cut(preset_config("wan 2.2 Animate-2 14B LoRA 24GB"), 30, 24)
    layouts, why = layouts_of(config, arch)
    assert layouts == [] and "Animate-2" in why and "does not compose exactly" in why, why


def test_every_block_swapped_composes_exactly():
    """A fit's first setting swaps every block (no block before the swapped run)."""
    config, arch = cut(preset_config("wan 2.1 14B LoRA 24GB"), 18, 18)
    assert_same(predict(config, SHAPE, arch), predict(config, SHAPE, arch, exact=True))


@pytest.mark.parametrize("name", ["wan 2.1 VACE 14B LoRA 24GB", "wan 2.2 Animate 14B LoRA 24GB",
                                  "wan 2.2 VACE-Fun A14B LoRA high"])
def test_blocks_that_repeat_every_fifth_are_traced_whole_and_the_plan_says_why(name):
    """VACE 14B (a VACE block beside every 5th) and Animate (a face adapter after every 5th): 40 blocks are too few
    periods of 5 to compose with fewer traced blocks; the plan is the exact one and says so."""
    config = preset_config(name)
    layouts, why = layouts_of(config, resolve_architecture(config))
    assert layouts == [] and "repeat every 5 blocks" in why, why


def test_settings_that_differ_in_swapped_blocks_share_their_cut_traces():
    """A fit bisects over the swapped blocks' count: every count of the same checkpointing traces the same cut
    transformers, so the second plan traces nothing."""
    from modules.planner import composed_trace
    config, arch = cut(preset_config("wan 2.1 14B LoRA 24GB"), 30, 24)
    predict(config, SHAPE, arch)
    kept = len(composed_trace._traces)
    reports = []
    config.performance.block_swap = 22
    prediction = predict(config, SHAPE, arch, progress=lambda *report: reports.append(report))
    assert len(composed_trace._traces) == kept and prediction.how.startswith("composed")
    assert reports and reports[-1][0] == reports[-1][1]


def _trace_in_process(folder, *job):
    """composed_trace._trace_numbers, leaving a file named after the process that ran it."""
    (folder / str(os.getpid())).touch()
    return TRACE_NUMBERS(*job)


def test_cut_traces_run_side_by_side_in_worker_processes_and_give_the_same_plan(tmp_path, monkeypatch):
    """The cut traces of one plan run in worker processes at once (trace_pool.py): the plan equals the one traced
    in this process, every number, and the progress reports count every trace."""
    import functools

    from modules.planner import composed_trace
    config, arch = cut(preset_config("wan 2.1 14B LoRA 24GB"), 30, 24)
    plans, folders, reports = {}, {}, {}
    for workers in ("1", "2"):
        monkeypatch.setenv("WAN_PLANNER_WORKERS", workers)
        folders[workers] = tmp_path / workers
        folders[workers].mkdir()
        monkeypatch.setattr(composed_trace, "_trace_numbers", functools.partial(_trace_in_process, folders[workers]))
        monkeypatch.setattr(composed_trace, "_traces", composed_trace.OrderedDict())
        reports[workers] = []
        plans[workers] = predict(config, SHAPE, arch, progress=lambda *report: reports[workers].append(report))
    assert plans["1"].how == plans["2"].how == "composed from 4 traces of 4, 5, 6 of 30 blocks"
    for field in COMPARED:
        assert getattr(plans["1"], field) == getattr(plans["2"], field), field
    assert [p.name for p in folders["1"].iterdir()] == [str(os.getpid())]
    ran_in = {p.name for p in folders["2"].iterdir()}
    assert len(ran_in) == 2 and str(os.getpid()) not in ran_in
    for workers in ("1", "2"):
        assert [(done, total) for done, total, _text in reports[workers]] == [(n, 4) for n in range(1, 5)]


@pytest.mark.skipif(not os.environ.get("WAN_PLANNER_FULL"),
                    reason="the whole 14B and 1.3B traced at real size (minutes on 2 cores): set WAN_PLANNER_FULL=1")
@pytest.mark.parametrize("name,overrides", [
    ("wan 2.1 14B LoRA 24GB", ()),
    ("wan 2.1 1.3B LoRA 24GB", ("data.resolution=832x480", "data.frame_buckets=[81]")),
])
def test_the_real_size_plans_compose_exactly(name, overrides):
    """Measured in this session for the 14B LoRA 24GB preset (81x544x736, fp8, block swap 34, activation offload):
    composed from 4 traces of 4, 5, 6 of 40 blocks, equal to the exact plan in every number (10,104,475,016 bytes
    traced), 39 s of CPU time against 70 s exact (a shared 2-core machine at load 12-15)."""
    config = preset_config(name, *overrides)
    arch = resolve_architecture(config)
    shape = largest_shape(config, arch)
    assert_same(predict(config, shape, arch), predict(config, shape, arch, exact=True))


def test_a_plan_without_its_checking_traces_traces_fewer_blocks_and_the_same_numbers(monkeypatch):
    """A fit's candidates are composed without the traces that check their lines (`checked` False: two traces a
    line, not three): the same numbers where the lines hold, one trace fewer, and said so."""
    from collections import OrderedDict

    from modules.planner import composed_trace
    monkeypatch.setenv("WAN_PLANNER_WORKERS", "1")   # on one worker no checking trace is spare (the next test)
    # a checking trace kept from another test is spare (it costs nothing): none is kept here
    monkeypatch.setattr(composed_trace, "_traces", OrderedDict())
    config, arch = cut(preset_config("wan 2.1 14B LoRA 24GB"), 30, 24)
    reports = {True: [], False: []}
    plans = {checked: predict(config, SHAPE, arch, checked=checked, progress=lambda *r, c=checked: reports[c].append(r))
             for checked in (False, True)}
    assert plans[True].checked and plans[True].how == "composed from 4 traces of 4, 5, 6 of 30 blocks"
    assert not plans[False].checked, plans[False].how
    assert plans[False].how == "composed from 3 traces of 4, 5 of 30 blocks (no third trace checked the lines)"
    assert [total for _done, total, _text in reports[False]] == [3, 3, 3]
    for field in COMPARED:
        assert getattr(plans[False], field) == getattr(plans[True], field), field
    # 3 periods before the swapped blocks: a checked plan traces them as they are (5, 6, 7 blocks); without its
    # checking traces the run is extrapolated from 2 and 3 periods, the traces every swap count shares
    config.performance.block_swap = 27
    short = {checked: predict(config, SHAPE, arch, checked=checked) for checked in (False, True)}
    assert short[True].how == "composed from 3 traces of 5, 6, 7 of 30 blocks", short[True].how
    assert short[False].how.startswith("composed from 3 traces of 4, 5 of 30 blocks"), short[False].how
    for field in COMPARED:
        assert getattr(short[False], field) == getattr(short[True], field), field


def test_a_fit_answers_with_a_checked_plan_and_searches_again_where_a_check_fails(monkeypatch):
    """memory_plan.fit over a memory model (the search itself: tests/test_memory_auto_fit.py; the traces: the test
    above): the candidates are predicted unchecked and the answer again, checked. Where the checked plan of the
    answer differs (a line that did not hold: here the unchecked plans of every-block checkpointing with swapped
    blocks come out 1 GiB low), the search runs again on checked plans only, and answers what they say: the
    answer of a fit whose plans are all right."""
    from modules.planner import memory_plan
    from modules.planner.auto_fit import canonical, settings_of
    from modules.planner.Prediction import GIB, Prediction
    from tests.test_memory_auto_fit import grid_model
    config = preset_config("wan 2.1 1.3B LoRA 24GB")
    arch = resolve_architecture(config)
    layers = arch.transformer["num_layers"]
    _cost, memory = grid_model(layers)
    low = {"by": 0.0}
    predicted = []

    def model_predict(config, shape=None, arch=None, exact=False, checked=True, **_):
        settings = canonical(settings_of(config), layers)
        wrong = (not checked and settings.gradient_checkpointing and settings.checkpoint_every == 1
                 and 0 < settings.block_swap < layers)
        predicted.append((settings, checked))
        gib = memory(settings) - (low["by"] if wrong else 0.0)
        return Prediction(model=arch.name, shape=shape.text(), settings=settings.config_values(),
                          traced_bytes=int(gib * GIB), parts={"weights": int(gib * GIB)}, peak_phase="backward",
                          host_pinned_bytes=0, parameters=1_400_000_000, trainable_parameters=40_000_000,
                          features="", seconds=0.0, checked=checked)

    monkeypatch.setattr(memory_plan, "predict", model_predict)
    monkeypatch.setattr(memory_plan, "floor_bytes", lambda *_args, **_kw: 0)
    refits = 0
    for vram in (12.0, 16.0, 20.0, 24.0, 28.0):
        low["by"], predicted[:] = 0.0, []
        right = memory_plan.fit(config, vram, arch=arch, shape=SHAPE)
        unchecked = [settings for settings, checked in predicted if not checked]
        assert unchecked and right.prediction.checked, (vram, predicted)
        assert [checked for _s, checked in predicted].count(True) <= 1, (vram, predicted)
        low["by"], lines = 1.0, []
        answer = memory_plan.fit(config, vram, log=lines.append, arch=arch, shape=SHAPE)
        assert answer.settings == right.settings and answer.prediction.checked, (vram, answer.settings)
        refits += any("every setting is predicted again, checked" in line for line in lines)
    assert refits, "no card size made a check fail"


def test_checking_traces_are_added_where_the_workers_would_wait_anyway(monkeypatch):
    """A candidate's checking traces are traced with it where they end its traces at most an eighth later (on 2
    workers: 4, 5 and 5 blocks end at 9, with the check's 6 at 10); not where they would take most of a
    candidate's time (2 and 3 blocks end at 3, with the check's 4 at 5), nor on one worker."""
    from collections import OrderedDict

    from modules.planner import composed_trace, trace_pool
    monkeypatch.setenv("WAN_PLANNER_WORKERS", "2")
    monkeypatch.setattr(composed_trace, "_traces", OrderedDict())
    assert [trace_pool.makespan(sizes) for sizes in ([4, 5, 5], [4, 5, 5, 6], [2, 3], [2, 3, 4])] == [9, 10, 3, 5]
    swapped = cut(preset_config("wan 2.1 14B LoRA 24GB"), 30, 24)
    unswapped = cut(preset_config("wan 2.1 1.3B LoRA 24GB"), 18, 0)
    spare = lambda config, arch: composed_trace._checks_are_spare(  # noqa: E731
        config, arch, SHAPE, layouts_of(config, arch)[0][0], False)
    assert spare(*swapped) and not spare(*unswapped)
    monkeypatch.setenv("WAN_PLANNER_WORKERS", "1")
    assert not spare(*swapped)
