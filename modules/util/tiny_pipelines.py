"""The tiny random model of any variant, as a pipeline object or saved as a diffusers folder: the one place that
knows every family. The parts and the base, VACE and Wan-Fun variants come from tiny_models, the Animate variants
from tiny_animate (which builds on tiny_models' parts); neither imports this module, so the imports run one way.

Deterministic: the same variant and seed give byte-identical weight files.
"""
from pathlib import Path

from modules.util.atomic import atomic_dir
from modules.util.portable_folder import make_portable
from modules.util.tiny_animate import ANIMATE_VARIANTS, make_animate_pipeline, save_animate_2
from modules.util.tiny_models import SPECS, VARIANTS, make_base_pipeline, replaceable_folder


def make_tiny_pipeline(variant: str, seed: int = 0):
    """The tiny pipeline object (not saved): the diffusers pipeline class the released model_index.json names
    (for Animate-2, whose diffusers pipeline is modular, its parts as a dict)."""
    if variant in ANIMATE_VARIANTS:
        return make_animate_pipeline(variant, seed)
    if variant not in SPECS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; one of {', '.join(VARIANTS + ANIMATE_VARIANTS)}")
    return make_base_pipeline(variant, seed)


def make_tiny_model(variant: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Writes a complete tiny diffusers folder for `variant` to `output_dir` and returns its path.

    An existing `output_dir` is replaced only when it is empty or itself a diffusers folder (has model_index.json);
    anything else raises FileExistsError rather than delete a folder that is not ours.
    """
    output_dir = replaceable_folder(output_dir)
    pipeline = make_tiny_pipeline(variant, seed)
    with atomic_dir(output_dir) as tmp:
        if isinstance(pipeline, dict):   # Animate-2's parts (its diffusers pipeline is modular)
            save_animate_2(pipeline, Path(tmp))
        else:
            pipeline.save_pretrained(tmp, safe_serialization=True)
        make_portable(tmp)   # loads under transformers 4 too, as the released repos do
    return output_dir
