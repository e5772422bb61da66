"""The VACE part of a transformer config, from tensor shapes and whatever config came with the file.

Layouts (sources; facts, not code):
- diffusers `WanVACETransformer3DModel` (diffusers/models/transformers/transformer_wan_vace.py): `vace_blocks.N.*`,
  `vace_patch_embedding`; config fields `vace_layers` (the base blocks each VACE block feeds, 0 first) and
  `vace_in_channels` (96 for the Wan 2.1 VAE: 2 x 16 latent channels + 64 mask channels).
- official release (Wan-Video/Wan2.1 wan/modules/vace_model.py `VaceWanModel`): the same blocks under the official
  Wan names plus `before_proj` (block 0) / `after_proj`; its config.json has `vace_layers` and `vace_in_dim`
  (`vace_layers` None means every second block: `range(0, num_layers, 2)`).
- ComfyUI single files (comfy/ldm/wan/model.py `VaceWanModel`, with or without `model.diffusion_model.`): the
  official names and no config; ComfyUI counts the VACE blocks and assumes they are evenly spaced,
  `range(0, num_layers, num_layers // len(vace_blocks))`. So do we when no config says otherwise.
"""
from modules.modelLoader.wan.parts.tensor_files import ModelFileError, TensorInfo

VACE_CLASS = "WanVACETransformer3DModel"
OFFICIAL_VACE_CLASS = "VaceWanModel"


def is_vace_state(keys) -> bool:
    """True when the (diffusers-named) tensors hold VACE blocks."""
    return "vace_patch_embedding.weight" in keys


def evenly_spaced_layers(num_layers: int, vace_blocks: int) -> list[int]:
    """ComfyUI's assumption for a file without a config: the VACE blocks feed every (num_layers // n)-th block."""
    return list(range(0, num_layers, num_layers // vace_blocks))[:vace_blocks]


def official_vace_fields(config: dict) -> dict:
    """`vace_layers` / `vace_in_channels` of an official `VaceWanModel` config.json (None fields left out)."""
    fields = {}
    if config.get("vace_layers") is not None:
        fields["vace_layers"] = list(config["vace_layers"])
    elif config.get("_class_name") == OFFICIAL_VACE_CLASS and config.get("num_layers"):
        fields["vace_layers"] = list(range(0, config["num_layers"], 2))   # VaceWanModel's own default
    if config.get("vace_in_dim") is not None:
        fields["vace_in_channels"] = config["vace_in_dim"]
    return fields


def vace_config_fields(keys: dict[str, TensorInfo], num_layers: int, given: dict | None, source: str) -> dict:
    """The config fields a VACE state dict (diffusers names) implies; `given` may name `vace_layers`, which must
    fit the number of VACE blocks and the base blocks. Empty for a plain Wan transformer."""
    if not is_vace_state(keys):
        return {}
    count = 1 + max(int(k.split(".")[1]) for k in keys if k.startswith("vace_blocks."))
    layers = list((given or {}).get("vace_layers") or evenly_spaced_layers(num_layers, count))
    if len(layers) != count or layers[0] != 0 or max(layers) >= num_layers:
        raise ModelFileError(f"{source}: {count} VACE blocks and {num_layers} base blocks do not fit the given "
                             f"vace_layers {layers} (one base block per VACE block, the first 0)")
    return {"_class_name": VACE_CLASS, "vace_layers": layers,
            "vace_in_channels": keys["vace_patch_embedding.weight"].shape[1]}
