"""Where each part of a Wan model comes from, decided from headers and configs before any weight is read:
`model.base_model_name` (a diffusers folder, an official Wan release folder, a ComfyUI-style folder of single
files) and the per-part overrides (`model.<part>.path`: a file or folder in any layout). Every wrong combination is
reported here, naming the file: a part of the wrong kind, a VAE that does not fit the transformer, an I2V
transformer without an image encoder, a missing or truncated shard."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from modules.model.sampling_defaults import SamplingDefaults
from modules.modelLoader.wan.parts.recognise import FoundPart, find_parts
from modules.modelLoader.wan.parts.tensor_files import INDEX_SUFFIX, ModelFileError
from modules.modelLoader.wan.parts.wan_configs import (is_official_transformer_config, released_for_variant,
                                                       transformer_config_from_shapes, variant_from_transformer)
from modules.util.config.ModelConfig import ModelConfig
from modules.model.transformer_classes import TRANSFORMER_CLASSES
from modules.util.enum.WanVariant import WanVariant
from modules.util.wan_detection import TRANSFORMER_CLASSES

PART_NAMES = ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder")
_KIND = {"transformer": "transformer", "transformer_2": "transformer", "vae": "vae", "text_encoder": "text_encoder",
         "image_encoder": "image_encoder"}
_WHAT = {"transformer": "a Wan transformer", "vae": "a Wan VAE", "text_encoder": "a UMT5 text encoder",
         "image_encoder": "a CLIP vision encoder"}


@dataclass
class ModelPlan:
    variant: WanVariant
    parts: dict[str, FoundPart]                 # part name -> where it comes from
    origins: dict[str, str]                     # part name -> the config field that named it
    transformer_configs: dict[str, dict]        # "transformer" / "transformer_2" -> WanTransformer3DModel config
    vae_config: dict | None
    model_index: dict
    scheduler_config: dict
    diffusers_base: Path | None                 # the base, when it is a diffusers folder
    messages: list[str] = field(default_factory=list)
    hub_image_encoder: str | None = None        # model.image_encoder.path as a hub id (fetched when it loads)
    sampling_defaults: SamplingDefaults | None = None   # the official settings, for a base that is no diffusers folder

    @property
    def transformer_dtypes(self) -> list[str]:
        return [self.parts[name].dtype for name in ("transformer", "transformer_2") if name in self.parts]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelFileError(f"{path}: not readable JSON") from None


def _pick(candidates: list[FoundPart], part: str, origin: str) -> FoundPart | None:
    kind = _KIND[part]
    matching = [c for c in candidates if c.part == kind]
    if kind == "transformer":
        by_role = [c for c in matching if c.role == part]
        if by_role:
            return by_role[0]
        unroled = [c for c in matching if c.role is None]
        if part == "transformer_2" or not unroled:
            return None   # the low-noise expert is never guessed
        if len(unroled) > 1:
            listed = ", ".join(str(c.folder or c.files[0]) for c in unroled)
            raise ModelFileError(f"{origin}: {len(unroled)} transformers found ({listed}); the two A14B experts "
                                 f"cannot be told apart by their tensors: put them in high_noise_model/ and "
                                 f"low_noise_model/, or name them with model.transformer.path (high noise) and "
                                 f"model.transformer_2.path (low noise)")
        return unroled[0]
    if len(matching) > 1:
        listed = ", ".join(str(c.folder or c.files[0]) for c in matching)
        raise ModelFileError(f"{origin}: {len(matching)} files hold {_WHAT[kind]} ({listed}); name one with "
                             f"model.{part}.path")
    return matching[0] if matching else None


def _override(config: ModelConfig, part: str) -> FoundPart | None:
    path = getattr(config, part).path
    if not path:
        return None
    if part.startswith("transformer") and Path(path).is_file() and not str(path).endswith(INDEX_SUFFIX):
        # transformers are released and shared as safetensors only (a sharded set may be named by its
        # `.safetensors.index.json`, whose shards shard_set checks); the restricted .pth reader is for the official
        # VAE, T5 and CLIP files
        from modules.util.safetensors_only import NotSafetensorsError, require_safetensors
        try:
            require_safetensors(path, f"model.{part}.path")
        except NotSafetensorsError as error:
            raise ModelFileError(str(error)) from None
    try:
        found = find_parts(path)
    except ModelFileError as error:  # named by the field that gave the path, not by the base model
        raise ModelFileError(f"model.{part}.path: {error}") from None
    kind = _KIND[part]
    matching = [c for c in found if c.part == kind]
    if not matching:
        what = ", ".join(sorted({f"{c.part} ({c.layout})" for c in found})) or "no model part"
        raise ModelFileError(f"model.{part}.path: {path} holds {what}, not {_WHAT[kind]}")
    if part.startswith("transformer") and len(matching) > 1:
        by_role = [c for c in matching if c.role == part]
        if by_role:
            return by_role[0]
    if len(matching) > 1:
        raise ModelFileError(f"model.{part}.path: {path} holds {len(matching)} of {_WHAT[kind]}; name one file")
    return matching[0]


def _hub_image_encoder(config: ModelConfig) -> str | None:
    """model.image_encoder.path when it names a hub id (nothing here by that name); refused without downloads."""
    from modules.util.config.image_encoder_source import looks_like_hub_id
    path = config.image_encoder.path
    if not path or not looks_like_hub_id(path):
        return None
    if not config.allow_download:
        raise ModelFileError(f"model.image_encoder.path: {path!r} is not a file or folder here; to fetch it as a hub "
                             f"id, set model.allow_download to true")
    return path


def plan_model(config: ModelConfig) -> ModelPlan:
    """Raises ModelFileError naming the file and what is wrong (nothing is loaded)."""
    base = Path(config.base_model_name) if config.base_model_name else None
    if base is None or not base.is_dir():
        raise ModelFileError(f"model.base_model_name: {config.base_model_name!r} is not a folder")
    diffusers_base = base if (base / "model_index.json").is_file() else None
    base_parts = find_parts(base)
    parts: dict[str, FoundPart] = {}
    origins: dict[str, str] = {}
    hub_image_encoder = _hub_image_encoder(config)
    for part in PART_NAMES:
        found = None if part == "image_encoder" and hub_image_encoder else _override(config, part)
        origin = f"model.{part}.path"
        if found is None:
            found, origin = _pick(base_parts, part, "model.base_model_name"), "model.base_model_name"
        if found is not None:
            parts[part] = found
            origins[part] = origin
    if "transformer" not in parts:
        if "transformer_2" in parts:
            raise ModelFileError("model.transformer.path: the high-noise expert is missing (only transformer_2 found)")
        raise ModelFileError(f"model.base_model_name: {base} holds no Wan transformer (found: "
                             f"{', '.join(p.part for p in base_parts) or 'no model part'}); set model.transformer.path")

    model_index = _read_json(diffusers_base / "model_index.json") if diffusers_base else {}
    transformer_configs = {name: _transformer_config(parts[name], diffusers_base, name)
                           for name in ("transformer", "transformer_2") if name in parts}
    vae = parts.get("vae")
    if vae is None:
        raise ModelFileError(f"model.base_model_name: {base} holds no Wan VAE; set model.vae.path (e.g. "
                             f"Wan2.1_VAE.pth, wan_2.1_vae.safetensors, or the Wan 2.2 VAE for TI2V-5B)")
    z_dim = vae.detail.z_dim
    main = transformer_configs["transformer"]
    out_channels = main.get("out_channels", main.get("out_dim"))
    if out_channels != z_dim:
        needs = "Wan 2.2 TI2V-5B needs the Wan 2.2 VAE" if out_channels == 48 else "it needs the Wan 2.1 VAE"
        raise ModelFileError(f"{origins['vae']}: {vae.files[0]} is the Wan {vae.detail.version} VAE ({z_dim} latent "
                             f"channels) but the transformer {parts['transformer'].files[0]} works on "
                             f"{out_channels} channels ({needs})")
    second = transformer_configs.get("transformer_2")
    if second is not None and second["in_channels"] != main["in_channels"]:
        raise ModelFileError(f"{origins['transformer_2']}: the low-noise expert takes {second['in_channels']} input "
                             f"channels, the high-noise expert {main['in_channels']}: they are not one A14B pair")
    variant = variant_from_transformer(main, z_dim, "transformer_2" in parts)
    if (main.get("image_dim") or main.get("use_img_emb")) and "image_encoder" not in parts and not hub_image_encoder:
        raise ModelFileError(f"{origins['transformer']}: {parts['transformer'].files[0]} is a Wan {variant.value} "
                             f"transformer with an image (CLIP) branch and no image encoder was found: set "
                             f"model.image_encoder.path to clip_vision_h.safetensors or the official "
                             f"models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    if "text_encoder" not in parts:
        raise ModelFileError(f"model.base_model_name: {base} holds no UMT5 text encoder; set model.text_encoder.path "
                             f"(e.g. umt5_xxl_fp16.safetensors or models_t5_umt5-xxl-enc-bf16.pth)")
    _check_encoders(parts)
    sampling_defaults = None
    if diffusers_base:
        scheduler_config = _read_json(diffusers_base / "scheduler" / "scheduler_config.json")
    else:
        # no scheduler config of its own: the released model's, sampled with the official code's settings
        width = main.get("dim") or main["num_attention_heads"] * main["attention_head_dim"]
        release = released_for_variant(variant, width)
        sampling_defaults = SamplingDefaults.from_json(release["sampling"])
        model_index = dict(release["model_index"])
        scheduler_config = dict(release["scheduler"], flow_shift=sampling_defaults.flow_shift)
    vae_config = vae.config if vae.config and vae.config.get("_class_name") == "AutoencoderKLWan" else None
    if vae_config is None and diffusers_base and (diffusers_base / "vae" / "config.json").is_file():
        base_vae = _read_json(diffusers_base / "vae" / "config.json")
        vae_config = base_vae if base_vae.get("z_dim", 16) == z_dim else None
    plan = ModelPlan(variant, parts, origins, transformer_configs, vae_config, model_index, scheduler_config,
                     diffusers_base, hub_image_encoder=hub_image_encoder, sampling_defaults=sampling_defaults)
    plan.messages = [f"{name}: {found.describe()} [{origins[name]}]{_storage_note(config, name, found)}"
                     for name, found in parts.items()]
    if hub_image_encoder:
        plan.messages.append(f"image_encoder: {hub_image_encoder} (hub id, fetched when it loads) "
                             f"[model.image_encoder.path]")
    plan.messages.insert(0, f"model: Wan {variant.value}, found by the transformer's tensors"
                            + ("" if diffusers_base else f"; scheduler and pipeline settings of the released "
                                                         f"{variant.value} model (resources/wan_configs)"))
    return plan


def _storage_note(config: ModelConfig, name: str, found: FoundPart) -> str:
    """How an fp8 transformer file is held: float8 in memory, computed in the weight dtype's compute type."""
    if not name.startswith("transformer") or not found.dtype.startswith("fp8"):
        return ""
    compute = str(getattr(config, name).weight_dtype.torch_dtype()).removeprefix("torch.")
    return f"; kept in float8, computed in {compute}"


def _check_encoders(parts: dict[str, FoundPart]) -> None:
    """The encoders read from files, checked tensor by tensor from their headers (files-enc's plans)."""
    from modules.modelLoader.wan.parts.text_encoder_files import plan_text_encoder
    text = parts["text_encoder"]
    if text.folder is None:
        plan_text_encoder(text.keys, text.layout, str(text.files[0]))
    image = parts.get("image_encoder")
    if image is not None and image.folder is None:
        from modules.modelLoader.wan.parts.image_encoder_files import _beside_config as clip_config_beside
        from modules.modelLoader.wan.parts.image_encoder_files import plan_image_encoder
        plan_image_encoder(image.keys, image.layout, str(image.files[0]), clip_config_beside(image.files[0]))


def _transformer_config(found: FoundPart, diffusers_base: Path | None, name: str) -> dict:
    source = str(found.folder or found.files[0])
    given = None
    if found.config and (found.config.get("_class_name") in TRANSFORMER_CLASSES
                         or is_official_transformer_config(found.config)):
        given = found.config   # a diffusers config, or the official code's (read by transformer_config_from_shapes)
    if given is None and diffusers_base is not None:
        for sub in (name, "transformer", "transformer_2"):
            if (diffusers_base / sub / "config.json").is_file():
                candidate = _read_json(diffusers_base / sub / "config.json")
                width = found.detail.shapes["patch_embedding.weight"].shape[0]
                if (candidate.get("dim") or candidate.get("num_attention_heads", 0)
                        * candidate.get("attention_head_dim", 0)) == width:
                    given = candidate
                break
    if found.detail is None:
        raise ModelFileError(f"{source}: the transformer's tensors were not recognised")
    from modules.modelLoader.wan.parts.transformer_files import check_quantization
    check_quantization(found.detail, source)   # ComfyUI's nvfp4 / mxfp8 / int8 layers: named before anything loads
    if given is not None and given.get("_class_name") in TRANSFORMER_CLASSES and found.layout == "diffusers" \
            and found.folder is not None:
        return dict(given)
    return transformer_config_from_shapes(found.detail.shapes, source, given)


def uses_parts_loader(config: ModelConfig) -> bool:
    """True unless the whole model is a diffusers folder (or hub id) with diffusers-folder overrides only: then the
    parts are found by content (modules/modelLoader/wan/parts/)."""
    base = Path(config.base_model_name) if config.base_model_name else None
    if base is None or not base.is_dir():
        return False
    if not (base / "model_index.json").is_file() or config.tokenizer.path:
        return True
    for name in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder"):
        path = Path(getattr(config, name).path) if getattr(config, name).path else None
        if path is not None and (path.is_file() or path.is_dir() and not (path / "config.json").is_file()
                                 and not (path / "model_index.json").is_file()):
            return True
    return False


def plan_problems(config: ModelConfig, full_fine_tune: bool, dora: bool = False) -> list[str]:
    """Config-check problems (no weights read): the plan's errors (a missing tokenizer included), fp8 base weights
    for a full fine-tune, fp8_scaled weights under DoRA."""
    if not uses_parts_loader(config):
        return []
    from modules.modelLoader.wan.parts.tokenizer_files import load_tokenizer
    try:
        plan = plan_model(config)
        load_tokenizer(plan, config)   # small; a missing one is named here, before the run starts
    except ModelFileError as error:
        return [str(error)]
    problems = []
    for name in ("transformer", "transformer_2"):
        found = plan.parts.get(name)
        if found is not None and found.dtype.startswith("fp8") and full_fine_tune:
            problems.append(f"{plan.origins[name]}: {found.files[0]} holds {found.dtype} weights; a full "
                            f"fine-tune needs full-precision weights (bf16/fp16/fp32): train a LoRA on it, or "
                            f"use the bf16/fp16 release")
        if found is not None and found.dtype == "fp8_scaled" and dora:
            # peft's DoRA takes the norm of the stored weight, which here is weight / scale_weight
            problems.append(f"lora.dora: {found.files[0]} holds fp8_scaled weights, whose stored numbers are the "
                            f"weights divided by their scales; DoRA's weight norm would be wrong: train a plain "
                            f"LoRA (lora.dora false) or use an fp8_e4m3fn / bf16 file")
    return problems


def detect_model_variant(config: ModelConfig) -> WanVariant:
    """The variant of the model a config names, from configs and tensor headers (no weights read). Raises
    NotAWanModelError, as `detect_variant_from_folder` does for diffusers folders."""
    from modules.util.wan_detection import NotAWanModelError, detect_variant_from_folder
    if not uses_parts_loader(config):
        return detect_variant_from_folder(config.base_model_name)
    try:
        return plan_model(config).variant
    except ModelFileError as error:
        raise NotAWanModelError(str(error)) from None
