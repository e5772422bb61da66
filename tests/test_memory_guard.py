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


def test_writing_some_presets_keeps_the_others_stored_numbers(tmp_path):
    """`benchmark presets --plan --write --preset NAME`: the presets with NAME in their name are planned again, every
    other row and guard number is kept as stored, and the docs table shows them all."""
    import json
    data = preset_guard.load_stored()
    name = "demo tiny CPU"   # planned in no time: its model does not exist until the demo makes it
    data["full"] = [{**row, "status": "stale"} if row["preset"] == name else row for row in data["full"]]
    data["guard"][name] = {"status": "stale"}
    data_file, docs_file = tmp_path / "presets.json", tmp_path / "benchmarks.md"
    data_file.write_text(json.dumps(data), encoding="utf-8")
    docs_file.write_text(f"before\n{preset_guard.TABLE_START}\nold\n{preset_guard.TABLE_END}\nafter\n", encoding="utf-8")
    written = preset_guard.write(log=lambda _text: None, data_file=data_file, docs_file=docs_file, only="demo tiny")
    stored = preset_guard.load_stored()
    assert [row["preset"] for row in written["full"]] == [row["preset"] for row in stored["full"]]
    for row in written["full"]:
        expected = stored["full"][[r["preset"] for r in stored["full"]].index(row["preset"])]
        assert row == expected, row["preset"]   # planned again (demo) or kept (the others)
    assert written["guard"] == stored["guard"]
    assert json.loads(data_file.read_text(encoding="utf-8")) == json.loads(json.dumps(written))
    table = docs_file.read_text(encoding="utf-8")
    assert table.startswith("before\n") and table.endswith("after\n") and "\nold\n" not in table
    assert all(f"| {row['preset']} |" in table for row in stored["full"])
