"""The released variants' configs (resources/wan_configs/, see its README for the sources) and the transformer
config a weight file implies: every size is read from tensor shapes; only the head count is not in any shape, so it
comes from a config.json beside the file, the base model's config, or the released model of that width."""
import json
from functools import cache
from pathlib import Path

from modules.modelLoader.wan.parts import animate_files
from modules.modelLoader.wan.parts.fun_files import refuse_unsupported_fun
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo
from modules.modelLoader.wan.parts.vace_files import (OFFICIAL_VACE_CLASS, VACE_CLASS, official_vace_fields,
                                                      vace_config_fields)
from modules.util.enum.WanVariant import WanVariant
from modules.util.wan_detection import fun_variant, transformer_width

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
    """A `WanTransformer3DModel` (with VACE blocks `WanVACETransformer3DModel`) config for a state dict in diffusers
    names (`keys`); `given` (a config.json beside the file or the base model's transformer config) supplies the head
    count and is checked against the shapes. Animate's extra modules add their fields; Animate-2 has a config of its
    own (animate_files)."""
    refuse_unsupported_fun(keys, source)
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
    official = is_official_transformer_config(given)
    if official:
        problems = official_config_problems(given, derived, dim)
        if problems:
            raise ModelFileError(f"{source}: the official config.json beside it does not describe its tensors "
                                 f"({'; '.join(problems)}): it belongs to another model")
        given = {**released_configs()["wan2.1-t2v-14b"]["transformer"], **official_to_diffusers(given)}
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
    for field in ("vace_layers", "vace_in_channels"):   # a VACE config given for a plain file (or the reverse)
        template.pop(field, None)
    template["_class_name"] = "WanTransformer3DModel"
    template.update(vace_config_fields(keys, num_layers, given, source))
    if animate_files.DIFFUSERS_ANIMATE_MARKER in keys:
        template.update(animate_files.animate_config_fields(keys, num_layers, source))
    return template


# the official Wan code's transformer arguments (Wan-Video/Wan2.1 and Wan2.2 wan/modules/model.py `WanModel`) as a
# release's config.json holds them -> WanTransformer3DModel's; the releases' files add `"_class_name": "WanModel"`,
# a config written by other means (json.dump of the model's config) does not, so the fields decide
_OFFICIAL_SIZES = {"ffn_dim": "ffn_dim", "num_layers": "num_layers", "in_dim": "in_channels",
                   "out_dim": "out_channels", "freq_dim": "freq_dim", "text_dim": "text_dim"}
# what each official model_type implies about the tensors (Wan2.1 model.py: t2v, i2v, flf2v; Wan2.2: ti2v)
_MODEL_TYPE_CHECKS = {
    "t2v": ("in_dim equal to out_dim (no image condition)", lambda c: c["in_channels"] == c["out_channels"]),
    "flf2v": ("a first/last-frame position embedding (img_emb.emb_pos)", lambda c: bool(c.get("pos_embed_seq_len"))),
    "ti2v": ("48 latent channels (the Wan 2.2 VAE)", lambda c: c["out_channels"] == 48),
}


def is_official_transformer_config(config: dict | None) -> bool:
    return isinstance(config, dict) and config.get("_class_name") in (None, "WanModel", "WanAnimateModel", OFFICIAL_VACE_CLASS) \
        and isinstance(config.get("dim"), int) and isinstance(config.get("num_heads"), int) and config["num_heads"] > 0


def official_to_diffusers(config: dict) -> dict:
    """The WanTransformer3DModel fields an official config.json gives (head count and every size it states)."""
    heads = config["num_heads"]
    out = {"num_attention_heads": heads, "attention_head_dim": config["dim"] // heads,
           "eps": config.get("eps", 1e-6), "freq_dim": config.get("freq_dim", 256)}
    out.update({ours: config[theirs] for theirs, ours in _OFFICIAL_SIZES.items() if theirs in config})
    if "qk_norm" in config:
        out["qk_norm"] = "rms_norm_across_heads" if config["qk_norm"] else None
    if "cross_attn_norm" in config:
        out["cross_attn_norm"] = bool(config["cross_attn_norm"])
    out.update(official_vace_fields(config))
    return out


def official_config_problems(official: dict, derived: dict, dim: int) -> list[str]:
    """Where an official config.json contradicts the tensors it sits beside (`derived`: the sizes they give)."""
    problems = [] if official["dim"] == dim else [f"dim {official['dim']}, the tensors {dim}"]
    if official["dim"] % official["num_heads"]:
        problems.append(f"dim {official['dim']} is not a multiple of num_heads {official['num_heads']}")
    for theirs, ours in _OFFICIAL_SIZES.items():
        if theirs in official and official[theirs] != derived[ours]:
            problems.append(f"{theirs} {official[theirs]}, the tensors {derived[ours]}")
    check = _MODEL_TYPE_CHECKS.get(official.get("model_type"))
    if check is not None and not check[1](derived):
        problems.append(f"model_type {official['model_type']!r} needs {check[0]}, the tensors have none")
    return problems


def variant_from_transformer(config: dict, z_dim: int, two_experts: bool) -> WanVariant:
    """As `modules.util.wan_detection.detect_variant`, from configs alone (no model_index.json)."""
    by_class = {animate_files.ANIMATE_CLASS: WanVariant.ANIMATE_14B, animate_files.ANIMATE_2_CLASS: WanVariant.ANIMATE_2_14B}
    if config.get("_class_name") in by_class:
        return by_class[config["_class_name"]]
    in_channels = config["in_channels"]
    takes_condition = in_channels == 2 * z_dim + 4
    if config.get("_class_name") != VACE_CLASS:
        fun = fun_variant(in_channels, z_dim, two_experts, transformer_width(config))
        if fun is not None:
            return fun
    if config.get("_class_name") == VACE_CLASS:
        return WanVariant.VACE_A14B if two_experts else WanVariant.VACE
    if two_experts:
        return WanVariant.I2V_A14B if takes_condition else WanVariant.T2V_A14B
    if z_dim == 48:
        return WanVariant.TI2V_5B
    if takes_condition:
        return WanVariant.FLF2V if config.get("pos_embed_seq_len") else WanVariant.I2V
    return WanVariant.T2V
