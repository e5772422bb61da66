"""The released variants' configs (resources/wan_configs/, see its README for the sources) and the transformer
config a weight file implies: every size is read from tensor shapes; only the head count is not in any shape, so it
comes from a config.json beside the file, the base model's config, or the released model of that width."""
import json
from functools import cache
from pathlib import Path

from modules.modelLoader.wan.parts import animate_files
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo
from modules.util.enum.WanVariant import WanVariant

CONFIG_DIR = Path(__file__).resolve().parents[4] / "resources" / "wan_configs"
HEAD_DIM = 128   # every released Wan transformer: 1536 / 128 = 12, 3072 / 128 = 24, 5120 / 128 = 40 heads


@cache
def released_configs() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(CONFIG_DIR.glob("*.json"))}


def released_for_variant(variant: WanVariant, width: int | None = None) -> dict:
    """The released model of `variant` (the one of that transformer width when there are two, e.g. T2V 1.3B/14B)."""
    candidates = [c for c in released_configs().values() if c["variant"] == variant.value]
    for config in candidates:
        transformer = config["transformer"]
        if width is None or transformer.get("num_attention_heads", transformer.get("num_heads")) * HEAD_DIM == width:
            return config
    return candidates[0]


def transformer_config_from_shapes(keys: dict[str, TensorInfo], source: str,
                                   given: dict | None = None) -> dict:
    """A `WanTransformer3DModel` config for a state dict in diffusers names (`keys`); `given` (a config.json beside
    the file or the base model's transformer config) supplies the head count and is checked against the shapes.
    Animate's extra modules add their fields; Animate-2 has a config of its own (animate_files)."""
    if animate_files.is_diffusers_animate_2(keys):
        return animate_files.animate_2_config(keys, source, given)

    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise ModelFileError(f"{source}: no tensor {name!r}; not a complete Wan transformer")
        return keys[name].shape

    patch = shape("patch_embedding.weight")           # (dim, in_channels, pt, ph, pw)
    dim, in_channels, patch_size = patch[0], patch[1], list(patch[2:])
    num_layers = 1 + max(int(k.split(".")[1]) for k in keys if k.startswith("blocks."))
    derived = dict(
        patch_size=patch_size, in_channels=in_channels,
        out_channels=shape("proj_out.weight")[0] // (patch_size[0] * patch_size[1] * patch_size[2]),
        text_dim=shape("condition_embedder.text_embedder.linear_1.weight")[1],
        freq_dim=shape("condition_embedder.time_embedder.linear_1.weight")[1],
        ffn_dim=shape("blocks.0.ffn.net.0.proj.weight")[0], num_layers=num_layers,
        image_dim=None, added_kv_proj_dim=None, pos_embed_seq_len=None,
    )
    if "condition_embedder.image_embedder.ff.net.0.proj.weight" in keys:
        derived["image_dim"] = shape("condition_embedder.image_embedder.ff.net.0.proj.weight")[1]
    if "blocks.0.attn2.add_k_proj.weight" in keys:
        derived["added_kv_proj_dim"] = shape("blocks.0.attn2.add_k_proj.weight")[1]
    if "condition_embedder.image_embedder.pos_embed" in keys:
        derived["pos_embed_seq_len"] = shape("condition_embedder.image_embedder.pos_embed")[1]
    if given:
        heads, head_dim = given.get("num_attention_heads"), given.get("attention_head_dim")
        if not heads or not head_dim or heads * head_dim != dim:
            raise ModelFileError(f"{source}: its width {dim} does not fit the given config ({heads} heads of "
                                 f"{head_dim}); the config belongs to another model")
        template = dict(given)
    elif dim % HEAD_DIM == 0:
        template = dict(released_configs()["wan2.1-t2v-14b"]["transformer"])
        template.update(num_attention_heads=dim // HEAD_DIM, attention_head_dim=HEAD_DIM)
    else:
        raise ModelFileError(f"{source}: a transformer {dim} wide is not a released Wan size; its head count is in "
                             f"no tensor shape: put its config.json beside the file")
    template.update(derived)
    template["_class_name"] = "WanTransformer3DModel"
    if animate_files.DIFFUSERS_ANIMATE_MARKER in keys:
        template.update(animate_files.animate_config_fields(keys, num_layers, source))
    return template


def variant_from_transformer(config: dict, z_dim: int, two_experts: bool) -> WanVariant:
    """As `modules.util.wan_detection.detect_variant`, from configs alone (no model_index.json)."""
    by_class = {animate_files.ANIMATE_CLASS: WanVariant.ANIMATE_14B, animate_files.ANIMATE_2_CLASS: WanVariant.ANIMATE_2_14B}
    if config.get("_class_name") in by_class:
        return by_class[config["_class_name"]]
    in_channels = config["in_channels"]
    takes_condition = in_channels == 2 * z_dim + 4
    if two_experts:
        return WanVariant.I2V_A14B if takes_condition else WanVariant.T2V_A14B
    if z_dim == 48:
        return WanVariant.TI2V_5B
    if takes_condition:
        return WanVariant.FLF2V if config.get("pos_embed_seq_len") else WanVariant.I2V
    return WanVariant.T2V
