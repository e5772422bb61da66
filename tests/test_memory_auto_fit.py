"""The memory planner's auto-fit (performance.auto_fit, `plan --fit`): the search for the cheapest switches that fit
a card, against the whole grid of a memory model with the planner's shape and against real-size 14B plans; the
floors that let it pass settings over unpredicted; auto_fit applied at train start. (The planner's predictions
themselves: tests/test_memory_planner.py.)"""
import pytest

from tests.test_memory_planner import SWITCHES, TINY_SHAPE, preset_config, tiny_config


@pytest.mark.skipif(not __import__("os").environ.get("WAN_PLANNER_FULL"),
                    reason="about 40 real-size 14B traces (~14 min on 2 cores): set WAN_PLANNER_FULL=1")
def test_auto_fit_picks_the_cheapest_fitting_switches_for_the_14b_preset():
    """For 12, 16, 24, 48 and 80 GiB: the choice is predicted to fit, and no setting of the switch grid that costs
    less also fits. The grid is every checkpointing / offload combination with every swap count; a combination's
    cheaper settings are its fewer-swap ones, and since more swapped blocks never predict more
    (tests/test_memory_planner.py), the one with the most swapped blocks below the chosen cost stands for them all."""
    from modules.planner.auto_fit import Settings, block_weight_bytes, canonical, combinations, fit, step_cost
    from modules.planner.memory_plan import predict
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    config = preset_config("wan 2.1 14B LoRA 24GB")
    arch = resolve_architecture(config)
    shape = largest_shape(config, arch)
    layers = arch.transformer["num_layers"]
    cache = {}

    def predict_settings(settings: Settings):
        settings = canonical(settings, layers)
        if settings not in cache:
            cache[settings] = predict(settings.apply(config), shape, arch)
        return cache[settings]

    first = predict_settings(Settings(True, 1, 0, False))
    cost = step_cost(arch, shape, block_weight_bytes(first.parameters, layers, 1))
    chosen = {}
    for vram in (12, 16, 24, 48, 80):
        result = fit(config, vram, predict_settings, layers, cost)
        chosen[vram] = result.settings
        if result.settings is None:
            frugal = predict_settings(Settings(True, 1, layers, True))
            assert not frugal.fits(vram), f"{vram} GiB: nothing chosen, yet every switch at its most fits"
            continue
        assert predict_settings(result.settings).fits(vram), (vram, result.settings)
        best = (cost.seconds(result.settings), result.settings.block_swap, result.settings.activation_offload)
        for base in combinations():
            cheaper = [n for n in range(layers + 1) if (cost.seconds(Settings(
                base.gradient_checkpointing, base.checkpoint_every, n, base.activation_offload)), n,
                base.activation_offload) < best]
            if cheaper:
                most = Settings(base.gradient_checkpointing, base.checkpoint_every, max(cheaper),
                                base.activation_offload)
                assert not predict_settings(most).fits(vram), f"{vram} GiB: {most.text()} is cheaper and fits"
    assert chosen[80] is not None



def grid_model(layers: int):
    """(a StepCost, GiB of Settings): a memory model with the planner's shape (monotonic in swapped blocks,
    activations per kept block), for the search alone."""
    from modules.planner.auto_fit import Settings, StepCost
    cost = StepCost(layers=layers, block_forward_seconds=0.01, block_copy_seconds=0.02, input_copy_seconds=0.015,
                    attention_inputs_seconds=0.003)

    def memory(settings: Settings) -> float:
        checkpointed = set(range(layers - settings.block_swap, layers))
        if settings.gradient_checkpointing:
            checkpointed |= set(range(0, layers, settings.checkpoint_every))
        kept = (layers - len(checkpointed)) * 3.0 + len(checkpointed) * (0.1 if settings.activation_offload else 0.6)
        # the attention inputs in chunks lower the transient (3.0 GiB fits with them only)
        return 1.0 + (layers - settings.block_swap) * 0.5 + kept + (0.7 if settings.attention_inputs else 1.5)
    return cost, memory


@pytest.mark.parametrize("vram", [3.0, 6.0, 9.0, 14.0, 40.0])
def test_auto_fit_search_against_the_whole_grid(vram):
    """The search alone, over a memory model with the planner's shape (monotonic in swapped blocks, activations
    per kept block), against every setting of the grid enumerated: the choice fits, nothing cheaper fits, and a
    setting the run cannot use (a swap with `refuse_swap`) is passed over."""
    import dataclasses
    from types import SimpleNamespace

    from modules.planner.auto_fit import Settings, canonical, combinations, fit
    from modules.planner.plan_shapes import PlanError
    layers = 12
    cost, memory = grid_model(layers)

    for refuse_swap in (False, True):
        def predict_settings(settings: Settings):
            settings = canonical(settings, layers)
            if refuse_swap and settings.block_swap:
                raise PlanError("cannot swap")
            gib = memory(settings)
            return SimpleNamespace(peak_gib=gib, fits=lambda v, g=gib: g <= v)

        result = fit(None, vram, predict_settings, layers, cost)
        grid = [Settings(b.gradient_checkpointing, b.checkpoint_every, n, b.activation_offload, b.attention_inputs)
                for b in combinations() for n in range(1 if refuse_swap else layers + 1)]
        fitting = [s for s in grid if memory(canonical(s, layers)) <= vram]
        if not fitting:
            assert result.settings is None, (vram, result.settings)
            continue
        key = lambda s: (cost.seconds(s), s.block_swap, s.activation_offload, s.attention_inputs)  # noqa: E731
        assert result.settings is not None and memory(canonical(result.settings, layers)) <= vram
        assert key(result.settings) == min(key(s) for s in fitting), (vram, refuse_swap, result.settings)
        # the attention inputs in chunks only where the same settings without them do not fit
        if result.settings.attention_inputs:
            without = dataclasses.replace(result.settings, attention_inputs=False)
            assert memory(canonical(without, layers)) > vram, (vram, result.settings)
        if vram == 3.0 and not refuse_swap:   # nothing fits without them
            assert result.settings.attention_inputs


def test_auto_fit_predicts_only_what_can_change_its_answer():
    """Each prediction of a real-size fit is a trace of seconds to minutes. At 30 blocks and five card sizes the
    search makes its choice (the grid's cheapest that fits) from 54 predictions: no setting whose floor (what its step
    starts with) exceeds the card is predicted, nor a swap count that costs more than the best found, and a
    combination whose count above the best's cost is known to fit starts its search there (56 when it traced that
    cost's count first). The search before (every swap count bisected from an all-swap trace, no floors) made 113
    for the same choices."""
    from types import SimpleNamespace

    from modules.planner.auto_fit import GIB, Settings, canonical, combinations, fit
    layers = 30
    cost, memory = grid_model(layers)
    weights = lambda settings: 1.0 + (layers - canonical(settings, layers).block_swap) * 0.5  # noqa: E731
    grid = [Settings(b.gradient_checkpointing, b.checkpoint_every, n, b.activation_offload, b.attention_inputs)
            for b in combinations() for n in range(layers + 1)]
    key = lambda s: (cost.seconds(s), s.block_swap, s.activation_offload, s.attention_inputs)  # noqa: E731
    predictions = passed_over = 0
    for vram in (5.0, 8.0, 12.0, 20.0, 40.0):
        predicted, floored = set(), set()

        def predict_settings(settings: Settings):
            predicted.add(canonical(settings, layers))
            gib = memory(canonical(settings, layers))
            return SimpleNamespace(peak_gib=gib, fits=lambda v, g=gib: g <= v)

        def floor_settings(settings: Settings):
            floored.add(canonical(settings, layers))
            return int(weights(settings) * GIB)

        result = fit(None, vram, predict_settings, layers, cost, floor_settings=floor_settings)
        fitting = [s for s in grid if memory(canonical(s, layers)) <= vram]
        assert key(result.settings) == min(key(s) for s in fitting), (vram, result.settings)
        frugal = canonical(Settings(True, 1, layers, True, True), layers)
        assert not any(weights(s) > vram for s in predicted - {frugal}), vram
        assert all(weights(s) > vram for s, _gib in result.passed_over), vram
        predictions, passed_over = predictions + len(predicted), passed_over + len(result.passed_over)
    print("PREDICTIONS", predictions, passed_over)
    assert predictions <= 54 and passed_over, (predictions, passed_over)


def test_settings_a_fit_leaves_unpredicted_are_ones_the_whole_grid_finds_not_fitting():
    """A fit does not predict a setting where one with at least as much of every switch did not fit
    (FitResult.dominated). On the 1.3B preset's transformer cut to 4 blocks of its real width, against every setting
    of the grid predicted: at card sizes between each two of the grid's peaks, the fit chooses what the whole grid's
    cheapest fitting setting is, and none of the settings it left unpredicted fits; also where the settings that
    trace fewer blocks are predicted first (`trace_blocks`), which leaves more of the others unpredicted."""
    from modules.planner.auto_fit import Settings, block_weight_bytes, canonical, combinations, fit, step_cost
    from modules.planner.memory_plan import predict
    from modules.planner.plan_shapes import PlanShape
    from tests.test_composed_plan import cut
    config, arch = cut(preset_config("wan 2.1 1.3B LoRA 24GB"), 4, 0)
    shape = PlanShape(batch_size=1, frames=17, height=128, width=128)
    layers = arch.transformer["num_layers"]
    grid = {canonical(Settings(b.gradient_checkpointing, b.checkpoint_every, n, b.activation_offload,
                               b.attention_inputs), layers) for b in combinations() for n in range(layers + 1)}
    plans = {s: predict(s.apply(config), shape, arch) for s in grid}
    configured = plans[Settings(True, 1)]
    cost = step_cost(arch, shape, block_weight_bytes(configured.parameters, layers, 2))
    key = lambda s: (cost.seconds(s), s.block_swap, s.activation_offload, s.attention_inputs)  # noqa: E731
    levels = sorted({p.peak_gib for p in plans.values()})
    # as a real fit's: checkpointing every block composes from fewer traced blocks than every 2nd or none
    trace_blocks = lambda s: 9 if s.gradient_checkpointing and s.checkpoint_every == 1 else 18  # noqa: E731
    dominated, first = 0, set()
    for vram in [(low + high) / 2 for low, high in zip(levels, levels[1:])]:
        for blocks in (None, trace_blocks):
            predicted = set()

            def predict_settings(settings: Settings):
                predicted.add(canonical(settings, layers))
                return plans[canonical(settings, layers)]

            result = fit(config, vram, predict_settings, layers, cost, known={Settings(True, 1): configured},
                         trace_blocks=blocks)
            cheapest = min((s for s in grid if plans[s].fits(vram)), key=key)
            assert key(result.settings) == key(cheapest), (vram, result.settings, cheapest)
            for settings, bound in result.dominated:
                assert not plans[canonical(settings, layers)].fits(vram), (vram, settings, bound)
                assert canonical(settings, layers) not in predicted, (vram, settings)
            dominated += len(result.dominated)
            if blocks is not None:
                first |= {settings for settings, _bound in result.dominated}
    assert dominated
    # the every-2nd-block settings at no swap left unpredicted where every block checkpointed did not fit
    assert Settings(True, 2, 0, True) in first


def test_a_floor_is_under_the_predicted_peak(tiny_model):
    """The floor a fit passes settings over by (the step's start: weights, adapters, optimizer state) is never
    above the prediction of the same setting, and holds the weights it keeps on the device."""
    from modules.planner.memory_plan import floor_bytes, predict
    from modules.planner.plan_shapes import resolve_architecture
    for switches in ("lora", "fine-tune", "block swap"):
        config = tiny_config(tiny_model("wan2.1-t2v"), **SWITCHES[switches])
        arch = resolve_architecture(config)
        prediction = predict(config, TINY_SHAPE, arch)
        floor = floor_bytes(config, TINY_SHAPE, arch)
        assert prediction.parts["weights"] < floor <= prediction.peak_bytes, switches


def test_auto_fit_in_the_config_sets_the_switches_at_train_start(tiny_model):
    """performance.auto_fit: G is applied before anything loads (also on a CPU device, where nothing is refused);
    a size nothing fits is refused with what the least would need."""
    from modules.planner.memory_plan import PlanError
    from modules.planner.plan_command import check_fits_device
    config = tiny_config(tiny_model("wan2.1-t2v"), gradient_checkpointing=True, performance={"auto_fit": 4.0},
                         data={"resolution": 64, "frame_buckets": [9]})
    lines = []
    check_fits_device(config, "cpu", out=lines.append)
    assert config.gradient_checkpointing is False   # nothing costs less than no memory switch at all
    assert lines and lines[0].startswith("memory plan (performance.auto_fit): fits 4 GiB with no checkpointing")
    config.performance.auto_fit = 0.1
    with pytest.raises(PlanError, match="performance.auto_fit 0.1: nothing fits 0.1 GiB: the least memory is"):
        check_fits_device(config, "cpu", out=lines.append)
