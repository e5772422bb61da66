"""Detects the Wan variant from the loaded configs, never from a file name (DESIGN.md section 1)."""
import json
from pathlib import Path

from modules.util.enum.WanVariant import WanVariant

WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline",
                 "WanAnimate2ModularPipeline", "WanAnimate2DistilledModularPipeline")
# a transformer class that alone decides the variant (its own conditioning; the pipeline must be its own)
_CLASS_VARIANTS = {"WanAnimateTransformer3DModel": WanVariant.ANIMATE_14B,
                   "WanAnimate2Transformer3DModel": WanVariant.ANIMATE_2_14B}
TRANSFORMER_CLASSES = ("WanTransformer3DModel", "WanVACETransformer3DModel", *_CLASS_VARIANTS)


class NotAWanModelError(ValueError):
    pass


# the released Wan 2.1 1.3B width (12 heads of 128); no I2V model of this width was released
WIDTH_1_3B = 1536


def fun_variant(in_channels: int, z_dim: int, two_experts: bool, width: int | None) -> WanVariant | None:
    """A Wan-Fun model (VideoX-Fun) told by its input channels, or None. The layouts (aigc-apps/VideoX-Fun
    videox_fun/pipeline/): Wan2.1-Fun Control `pipeline_wan_fun_control.py` joins control + start-image latents
    (3 x 16 = 48 with the noise); Wan2.2-Fun Control A14B `pipeline_wan2_2_fun_control.py` joins control + mask +
    masked video (16 + 16 + 4 + 16 = 52); Wan-Fun InP `pipeline_wan_fun_inpaint.py` joins mask + masked video
    (36), the I2V layout: a 14B InP cannot be told from Wan 2.1 I2V 14B by content (and needs not be: the tensors
    are the same), a 1.3B one can, as no 1.3B I2V exists."""
    if z_dim != 16:
        return None
    if in_channels == 3 * z_dim and not two_experts:
        return WanVariant.FUN_CONTROL
    if in_channels == 3 * z_dim + 4 and two_experts:
        return WanVariant.FUN_CONTROL_A14B
    if in_channels == 2 * z_dim + 4 and not two_experts and width == WIDTH_1_3B:
        return WanVariant.FUN_INP
    return None


def transformer_width(config: dict) -> int | None:
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    return heads * head_dim if heads and head_dim else None


def check_wan_pipeline(model_index: dict, source: str = "") -> None:
    pipeline_class = model_index.get("_class_name")
    if pipeline_class not in WAN_PIPELINES:
        raise NotAWanModelError(f"{source}: model_index.json names pipeline {pipeline_class!r}; a Wan model is one of "
                                f"{', '.join(WAN_PIPELINES)}")


def detect_variant(model_index: dict, transformer_config: dict, vae_config: dict, source: str = "") -> WanVariant:
    check_wan_pipeline(model_index, source)
    transformer_class = transformer_config.get("_class_name")
    if transformer_class in _CLASS_VARIANTS:
        return _CLASS_VARIANTS[transformer_class]
    if transformer_class not in TRANSFORMER_CLASSES:
        raise NotAWanModelError(f"{source}: the transformer is {transformer_class!r}, not one of "
                                f"{', '.join(TRANSFORMER_CLASSES)}")

    has_second_expert = bool(model_index.get("transformer_2")) and model_index["transformer_2"][0] is not None
    if transformer_class == "WanVACETransformer3DModel":
        return WanVariant.VACE_A14B if has_second_expert else WanVariant.VACE
    in_channels = transformer_config.get("in_channels")
    z_dim = vae_config.get("z_dim", 16)
    fun = fun_variant(in_channels, z_dim, has_second_expert, transformer_width(transformer_config))
    if fun is not None:
        return fun
    takes_condition = in_channels == 2 * z_dim + 4
    if has_second_expert:
        return WanVariant.I2V_A14B if takes_condition else WanVariant.T2V_A14B
    if model_index.get("expand_timesteps") or z_dim == 48:
        return WanVariant.TI2V_5B
    if takes_condition:
        # without an image branch: an E2V model trained on the VAE pathway alone; WanImageToVideoPipeline runs it
        # without an image encoder, as it runs Wan 2.2 I2V
        return WanVariant.FLF2V if transformer_config.get("pos_embed_seq_len") else WanVariant.I2V
    if in_channels == z_dim:
        return WanVariant.T2V
    raise NotAWanModelError(f"{source}: transformer in_channels {in_channels} fits no Wan variant for a VAE with "
                            f"z_dim {z_dim} (expected {z_dim} or {2 * z_dim + 4}, or a Wan-Fun model's "
                            f"{3 * z_dim} / {3 * z_dim + 4})")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def detect_variant_from_folder(folder: str | Path) -> WanVariant:
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise NotAWanModelError(f"{folder}: not a diffusers folder (no model_index.json)")
    model_index = read_json(index_path)
    expert = "transformer" if (folder / "transformer" / "config.json").is_file() else "transformer_2"
    for needed in (folder / expert / "config.json", folder / "vae" / "config.json"):
        if not needed.is_file():
            raise NotAWanModelError(f"{folder}: {needed.relative_to(folder)} is missing")
    return detect_variant(model_index, read_json(folder / expert / "config.json"),
                          read_json(folder / "vae" / "config.json"), str(folder))
