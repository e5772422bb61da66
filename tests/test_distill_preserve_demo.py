"""`distill.mode=preserve` on the tiny world: the demo trained with the shipped 4-step demo accelerator attached
ends with previews made in 4 accelerated steps that move the caption's way, and its LoRA, sampled accelerated,
draws the demo's captions (docs/distilled.md, "Training for the accelerator: preserve").

Measured (the demo preset, its seed 42, each LoRA sampled with the demo accelerator for the 6 captions at seeds 0
to 3; `caption_square_problems` passes of 24; docs/distilled.md has the table):

    LoRA trained with                              4 steps  2 steps  1 step  4 steps at strength 1.5
    distill.mode base                                21       20       18       19
    preserve, weight 0 (attached, no term)           21       19       19       20
    preserve, teacher on the step's caption, 0.5     16
    preserve, teacher on the step's caption, 0.1     19
    preserve, teacher on the empty caption, 0.5      22       22       21       22   (the default)

With the config's seed 1: base 21 / 18 / 17 / 21, preserve (the default) 22 / 20 / 19 / 22. The base LoRA already
passes at 4 steps; the harder case, where preserve wins, is the accelerator pushed past what it was distilled for:
one accelerated step (`sampling.accelerator.steps=1`, timestep 1000 alone), base 18 and 17, preserve 21 and 19.
Measured again after the merge (the shipped accelerator, one thread): 4 steps base 21, preserve 22; 1 step 18 and 18.
The margin is within the spread between runs: "not worse" is what the tests hold. Two LoRAs driven further from
the base were measured once each (docs/distilled.md): learning rate 0.03, base 11 / preserve 12 at 4 steps (the LoRA
alone 15 / 13: it breaks by itself); 1200 steps, base 23 / preserve 21 (alone 23 / 24). Neither is a win for preserve.
Where preserve does win is a stronger accelerator: the demo accelerator at strength 2, preserve trained with it at
that strength (training seeds 42, 1, 7, one step: base 12 / 14 / 15, preserve 17 / 19 / 22 of 24; 4 and 2 steps too).
Its runs take minutes, so scripts/demo_preserve_experiment.py measures it, not a test (docs/distilled.md).
"""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parent.parent
DEMO_ACCELERATOR = ROOT / "resources" / "demo" / "demo_accelerator.safetensors"
SEEDS = (0, 1, 2, 3)

pytestmark = pytest.mark.skipif(not DEMO_ACCELERATOR.is_file(), reason="the demo accelerator is not shipped")


def accelerated_passes(model_folder, lora_path, steps: int = 4) -> dict[str, list[bool]]:
    """{caption: [passes caption_square_problems at each seed]} for the demo's 6 captions ("a red square moving
    left"), the LoRA merged into the demo model and sampled with the demo accelerator at `steps` steps."""
    from modules.util.demo_accelerator import lora_passes
    return lora_passes(model_folder, lora_path, DEMO_ACCELERATOR, steps, seeds=SEEDS)


def _demo(work: Path, demo_model, *values: str) -> Path:
    """`train --preset-path "demo tiny CPU"` with these --config-value's, from `work` with the demo model and the
    accelerator (at resources/demo/) in place."""
    import os
    sys.path.insert(0, str(ROOT / "scripts"))
    import train
    shutil.copytree(demo_model, work / "workspace" / "demo" / "tiny-wan2.1-t2v")
    (work / "resources" / "demo").mkdir(parents=True)
    shutil.copy(DEMO_ACCELERATOR, work / "resources" / "demo" / DEMO_ACCELERATOR.name)
    before = os.getcwd()
    os.chdir(work)
    try:
        arguments = ["--preset-path", "demo tiny CPU"]
        for value in values:
            arguments += ["--config-value", value]
        assert train.main(arguments) == 0
    finally:
        os.chdir(before)
    return work


@pytest.fixture(scope="module")
def preserved_demo(tmp_path_factory, demo_model):
    """`train --preset-path "demo tiny CPU" --config-value distill.mode=preserve --config-value
    sampling.accelerator=resources/demo/demo_accelerator.safetensors`."""
    return _demo(tmp_path_factory.mktemp("demo-preserve"), demo_model, "distill.mode=preserve",
                 "sampling.accelerator=resources/demo/demo_accelerator.safetensors")


def test_the_demo_in_preserve_ends_with_accelerated_previews_moving_the_caption_way(preserved_demo):
    from modules.util.demo_assets import DEMO_SAMPLES
    from tests.demo_previews import last_previews
    found = last_previews(preserved_demo / "workspace" / "demo" / "run" / "samples", step=400)
    problems = {}
    for prompt, (last, found_problems) in found.items():
        record = json.loads(last.with_suffix(".json").read_text())
        assert record["steps"] == 4 and record["accelerator"]["timesteps"] == [1000, 750, 500, 250]
        problems[prompt] = found_problems
    assert problems == {sample["prompt"]: [] for sample in DEMO_SAMPLES}


def test_the_preserved_demo_lora_draws_the_captions_at_4_accelerated_steps(preserved_demo):
    torch.set_num_threads(1)
    passes = accelerated_passes(preserved_demo / "workspace" / "demo" / "tiny-wan2.1-t2v",
                                preserved_demo / "workspace" / "demo" / "output" / "demo_lora.safetensors")
    assert sum(sum(row) for row in passes.values()) >= 20, passes


def test_where_the_accelerator_is_stretched_preserve_is_not_worse_than_base(preserved_demo, tmp_path, demo_model):
    """The harder case: the demo's base-mode LoRA (trained as the preset says, previews off: they do not change
    training) against the preserve one, sampled with the accelerator at 4 steps and at 1 step: not worse at either.
    Measured on the branch: 22 / 21 (preserve) against 21 / 18 (base) of 24; measured again after the merge, with the
    shipped accelerator and this test's thread count: 22 / 18 against 21 / 18. So the one-step win is not robust
    (1 to 3 clips of 24, within the spread between runs); what holds in every run measured is "not worse"."""
    torch.set_num_threads(1)
    base = _demo(tmp_path, demo_model, "sampling.every_n_steps=0", "sampling.sample_before_training=false")
    lora = Path("workspace") / "demo" / "output" / "demo_lora.safetensors"
    model = Path("workspace") / "demo" / "tiny-wan2.1-t2v"
    passed = {}
    for name, work in (("base", base), ("preserve", preserved_demo)):
        for steps in (4, 1):
            passes = accelerated_passes(work / model, work / lora, steps)
            passed[name, steps] = sum(sum(row) for row in passes.values())
    assert passed["preserve", 4] >= passed["base", 4] and passed["preserve", 1] >= passed["base", 1], passed
