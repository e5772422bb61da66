"""What the planner needs to know about a run before tracing it: the transformer's architecture (from the base
model's own config.json, else the released variant's config shipped in resources/wan_configs) and the largest
training shape the data could produce (the largest-area resolution bucket, the longest frame bucket)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from modules.benchmark.architectures import Architecture
from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.WanVariant import WanVariant


class PlanError(ValueError):
    """The run cannot be planned (its model's size is unknown, or the config cannot run at all)."""


@dataclass(frozen=True)
class PlanShape:
    batch_size: int
    frames: int
    height: int
    width: int

    def text(self) -> str:
        return f"{self.frames}x{self.height}x{self.width} batch {self.batch_size}"


def _released_name(base: str) -> str | None:
    """'Wan-AI/Wan2.1-T2V-14B-Diffusers' -> 'wan2.1-t2v-14b' (the longest released name the id starts with)."""
    from modules.modelLoader.wan.parts.wan_configs import released_configs
    tail = base.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    names = sorted((n for n in released_configs() if tail.startswith(n)), key=len, reverse=True)
    return names[0] if names else None


def _architecture(name: str, released: dict, transformer: dict) -> Architecture:
    vae, index = released.get("vae", {}), released.get("model_index", {})
    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in transformer.items() if not k.startswith("_")}
    return Architecture(name, name, WanVariant(released["variant"]), config, z_dim=vae.get("z_dim", 16),
                        vae_spatial_stride=vae.get("scale_factor_spatial", 8),
                        vae_temporal_stride=vae.get("scale_factor_temporal", 4),
                        expand_timesteps=bool(index.get("expand_timesteps", False)),
                        boundary_ratio=index.get("boundary_ratio"), extra={"vae": vae})


def resolve_architecture(config: TrainConfig) -> Architecture:
    """The architecture the run trains, without any weight: a local base model's transformer/config.json (with
    its vae/ and model_index.json), else the released model its hub id names, else the released model of
    model.intended_variant."""
    from modules.modelLoader.wan.parts.wan_configs import released_configs, released_for_variant
    base = config.model.base_model_name or ""
    folder = Path(base)
    from modules.modelLoader.wan.parts.model_plan import uses_parts_loader
    if uses_parts_loader(config.model):
        return _architecture_from_files(config)
    if base and (folder / "transformer" / "config.json").is_file():
        transformer = json.loads((folder / "transformer" / "config.json").read_text(encoding="utf-8"))
        vae_path, index_path = folder / "vae" / "config.json", folder / "model_index.json"
        vae = json.loads(vae_path.read_text(encoding="utf-8")) if vae_path.is_file() else {}
        index = json.loads(index_path.read_text(encoding="utf-8")) if index_path.is_file() else {}
        from modules.modelLoader.wan.parts.wan_configs import variant_from_transformer
        variant = variant_from_transformer(transformer, vae.get("z_dim", 16), index.get("boundary_ratio") is not None)
        return _architecture(folder.name, {"variant": variant.value, "vae": vae, "model_index": index}, transformer)
    name = _released_name(base) if base else None
    if base and name is None and not _looks_like_hub_id(base):
        from modules.util.demo_paths import DEMO_MODEL, same_path
        if config.demo_assets and same_path(base, DEMO_MODEL):
            raise PlanError("the demo's tiny model is made at the first Start (a few MB on any card); it is "
                            "planned once it exists")
        raise PlanError(f"model.base_model_name {base!r}: no such folder with a transformer/config.json (build or "
                        f"download it first; a hub id or a released name is planned without it)")
    if name is not None:
        released = released_configs()[name]
        return _architecture(name, released, released["transformer"])
    variant = config.model.intended_variant
    if variant is not None and str(variant) not in ("", "AUTO", "None"):
        released = released_for_variant(WanVariant(getattr(variant, "value", variant)))
        return _architecture(str(variant), released, released["transformer"])
    raise PlanError(f"model.base_model_name {base!r}: neither a folder with transformer/config.json nor a released "
                    f"Wan model ({', '.join(released_configs())}); set model.intended_variant to plan it")


def _architecture_from_files(config: TrainConfig) -> Architecture:
    """A release folder, a folder of ComfyUI files or part files: the transformer's config from its tensor headers
    (as the loader finds it), the VAE's and the pipeline's from the files or else the released variant's."""
    from modules.modelLoader.wan.parts.model_plan import plan_model
    from modules.modelLoader.wan.parts.tensor_files import ModelFileError
    from modules.modelLoader.wan.parts.wan_configs import released_for_variant
    try:
        plan = plan_model(config.model)
    except ModelFileError as error:
        raise PlanError(str(error)) from None
    main = plan.transformer_configs["transformer"]
    released = released_for_variant(plan.variant, main["num_attention_heads"] * main["attention_head_dim"])
    vae = plan.vae_config or released["vae"]
    name = Path(str(plan.parts["transformer"].folder or plan.parts["transformer"].files[0])).name
    return _architecture(name, {"variant": plan.variant.value, "vae": vae, "model_index": plan.model_index}, main)


def _looks_like_hub_id(text: str) -> bool:
    """'org/name' (a hub id is planned by its released variant); a path ('./x', 'a/b/c', '/x') is not."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and "\\" not in text


def largest_shape(config: TrainConfig, arch: Architecture) -> PlanShape:
    """The most tokens a batch of this data can have: the largest-area bucket at the longest frame bucket."""
    from modules.util.resolution import make_buckets
    buckets = make_buckets(config.data.resolution, config.data.aspect_ratios, arch.spatial_unit)
    height, width = max(buckets, key=lambda b: (b[0] * b[1], b[1]))
    frames = max(config.data.frame_buckets)
    if (frames - 1) % arch.vae_temporal_stride:
        raise PlanError(f"data.frame_buckets: {frames} is not {arch.vae_temporal_stride}k+1")
    return PlanShape(config.batch_size, frames, height, width)
