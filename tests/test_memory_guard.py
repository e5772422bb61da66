"""The memory-regression guard: no shipped preset's predicted peak may grow by more than 3 % over the numbers in
docs/memory_presets.json (written by `benchmark presets --plan --write`, committed with the change that moves them).

The guard plans each preset at its real width and real largest bucket with its transformer cut to one block
(modules/planner/preset_guard.py): one block's transient (the wall) is planned exactly, the rest per block; a few
seconds per preset instead of minutes for the full plan."""
import pytest

from modules.planner import preset_guard

pytestmark = pytest.mark.memory_guard


@pytest.fixture(scope="module")
def stored():
    return preset_guard.load_stored()["guard"]


def test_no_preset_predicts_more_memory_than_its_stored_numbers(stored):
    current = preset_guard.guard_numbers()
    assert set(current) == set(stored), "presets added or removed: run `benchmark presets --plan --write`"
    messages = preset_guard.regressions(stored, current)
    assert not messages, "\n".join(messages)


def test_a_planted_regression_names_the_preset_and_the_part_that_grew(stored):
    """The feed-forward unchunked again (performance.chunk_tokens 0) is a real regression of the 1.3B preset's
    transient: the guard's message names the preset and the transient part."""
    from modules.util.config.config_io import load_config
    name = "wan 2.1 1.3B LoRA 16GB"
    config = load_config(preset_path=str(preset_guard.shipped_presets()[name]))
    config.performance.chunk_tokens = 0
    planted = {name: preset_guard._numbers(preset_guard.guard_prediction(config))}
    messages = preset_guard.regressions(stored, planted)
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{name}: predicted peak grew ") and "transient grew most" in messages[0], messages
    assert not preset_guard.regressions(stored, {name: stored[name]})
