"""The memory-regression guard: every shipped preset's predicted peak, kept in docs/memory_presets.json and in
docs/benchmarks.md's table, and the check that a change does not raise any of them by more than 3 %
(tests/test_memory_guard.py).

Two numbers per preset:
- `full`: the prediction at real size (every block, the largest bucket), the table users read. Planning every
  preset at real size takes minutes on a CPU, too long for a test.
- `guard`: the same run with the transformer cut to GUARD_BLOCKS blocks, at the real width and the real largest
  bucket (so one block's transient, the wall, is planned exactly; the kept block inputs, the weights and the
  optimizer state scale with the blocks, so a per-block regression shows at the same relative size), block swap
  scaled to the blocks left (`guard_settings`). Seconds per preset: this is what the test plans and compares.
- `host_bytes` (in `guard`): the host RAM peak at real size (host_plan.py, without the step's trace), guarded alike.

`benchmark presets --plan --write` plans both and writes the JSON and the table; commit them with the change that
moves them.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from modules.planner.memory_plan import PlanError, predict
from modules.planner.Prediction import PARTS, Prediction

GIB = 1024 ** 3
GUARD_BLOCKS = 1
TOLERANCE = 0.03
DATA_FILE = Path(__file__).resolve().parents[2] / "docs" / "memory_presets.json"
DOCS_FILE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
TABLE_START, TABLE_END = "<!-- preset-plan-table -->", "<!-- /preset-plan-table -->"


def shipped_presets() -> dict[str, Path]:
    from modules.util.presets import PRESET_DIR
    return {path.stem.lstrip("#"): path for path in sorted(PRESET_DIR.glob("*.json"))}


def guard_settings(config, layers: int):
    """The preset's config for GUARD_BLOCKS blocks: block swap N of `layers` becomes the same share of the blocks
    left (at least one when it swaps any)."""
    config = config.model_copy(deep=True)
    swap = config.performance.block_swap
    if swap:
        config.performance.block_swap = max(1, min(GUARD_BLOCKS, round(swap * GUARD_BLOCKS / layers)))
    return config


def guard_prediction(config) -> Prediction:
    from modules.planner.plan_shapes import resolve_architecture
    arch = resolve_architecture(config)
    layers = arch.transformer["num_layers"]
    cut = {"num_layers": GUARD_BLOCKS}
    if "vace_layers" in arch.transformer:                   # VACE: one VACE block, beside the first base block
        cut["vace_layers"] = list(range(GUARD_BLOCKS))[:1]
    if "inject_face_latents_blocks" in arch.transformer:    # Animate: a face adapter after the blocks kept
        cut["inject_face_latents_blocks"] = GUARD_BLOCKS
    small = dataclasses.replace(arch, transformer={**arch.transformer, **cut})
    return predict(guard_settings(config, layers), arch=small)


def _numbers(prediction: Prediction, host_bytes: int | None = None) -> dict:
    numbers = {"peak_bytes": prediction.peak_bytes, "parts": dict(prediction.parts)}
    if host_bytes is not None:
        numbers["host_bytes"] = host_bytes
    return numbers


def guard_host_bytes(config) -> int:
    """The preset's host RAM peak at real size (host_plan.py: the parts' sizes from their configs, no trace; the
    training step's pinned activations, which need the full trace, left out)."""
    from modules.planner.host_plan import plan_host
    return plan_host(config, cuda=True).peak_bytes


def guard_numbers(log=lambda _text: None, only: str | None = None) -> dict[str, dict]:
    """preset -> {peak_bytes, parts} of its guard plan, or {status} when it is not planned."""
    from modules.util.config.config_io import load_config
    numbers = {}
    for name, path in shipped_presets().items():
        if only is not None and name != only:
            continue
        try:
            config = load_config(preset_path=str(path))
            numbers[name] = _numbers(guard_prediction(config), guard_host_bytes(config))
        except PlanError as error:
            numbers[name] = {"status": f"not planned: {error}"}
        log(f"{name} (guard, {GUARD_BLOCKS} blocks): {numbers[name]}")
    return numbers


def regressions(stored: dict[str, dict], current: dict[str, dict], tolerance: float = TOLERANCE) -> list[str]:
    """One message per preset whose predicted peak grew by more than `tolerance`, naming the part that grew most;
    a preset missing from `stored` is a message too (write the numbers)."""
    messages = []
    for name, now in current.items():
        before = stored.get(name)
        if before is None:
            messages.append(f"{name}: no stored prediction (run `benchmark presets --plan --write`)")
            continue
        if "peak_bytes" not in now or "peak_bytes" not in before:
            if ("peak_bytes" in now) != ("peak_bytes" in before):
                messages.append(f"{name}: planned before: {before.get('status', 'yes')}; now: "
                                f"{now.get('status', 'yes')}")
            continue
        if "host_bytes" in now and "host_bytes" in before:
            host_growth = now["host_bytes"] / before["host_bytes"] - 1
            if host_growth > tolerance:
                messages.append(f"{name}: predicted host RAM peak grew {before['host_bytes'] / GIB:.2f} -> "
                                f"{now['host_bytes'] / GIB:.2f} GiB (+{host_growth:.1%}, more than {tolerance:.0%})")
        growth = now["peak_bytes"] / before["peak_bytes"] - 1
        if growth > tolerance:
            grown = {part: now["parts"].get(part, 0) - before["parts"].get(part, 0) for part in PARTS}
            part, delta = max(grown.items(), key=lambda item: item[1])
            messages.append(f"{name}: predicted peak grew {before['peak_bytes'] / GIB:.2f} -> "
                            f"{now['peak_bytes'] / GIB:.2f} GiB (+{growth:.1%}, more than {tolerance:.0%}); "
                            f"{part} grew most (+{delta / GIB:.2f} GiB)")
    return messages


def load_stored(path: Path = DATA_FILE) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def write(log=print, data_file: Path = DATA_FILE, docs_file: Path = DOCS_FILE, only: str | None = None) -> dict:
    """Plans every preset in full and in the guard's size; writes the JSON and the docs table. `only`: re-plans the
    presets with it in their name and keeps the others' stored numbers (a change that moves only those)."""
    from modules.planner.preset_table import markdown, preset_rows
    rows, guard = preset_rows(log=log, only=only), {}
    for name in shipped_presets():
        if only is None or only in name:
            guard.update(guard_numbers(log, only=name))
    if only is not None:
        stored = load_stored(data_file)
        planned = {row["preset"]: row for row in rows}
        rows = [planned.pop(row["preset"], row) for row in stored["full"]] + list(planned.values())
        guard = {**stored["guard"], **guard}
    data = {"guard_blocks": GUARD_BLOCKS, "tolerance": TOLERANCE, "full": rows, "guard": guard}
    from modules.benchmark.common import write_json
    write_json(str(data_file), data)
    text = docs_file.read_text(encoding="utf-8")
    table = f"{TABLE_START}\n{markdown(rows)}\n{TABLE_END}"
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{docs_file}: no {TABLE_START} ... {TABLE_END} markers to write the table between")
    docs_file.write_text(pattern.sub(lambda _m: table, text), encoding="utf-8")
    return data
