"""Loads the base weights of a Wan model: a diffusers folder, a hub id (only when asked), and per-part overrides,
including an original-format single-file transformer (official Wan / ComfyUI key names)."""
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from huggingface_hub.errors import HFValidationError
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

from modules.model.sampling_defaults import folder_defaults
from modules.model.WanModel import WanModel
from modules.model.transformer_classes import transformer_class
from modules.modelLoader.wan.parts.model_plan import plan_model, uses_parts_loader
from modules.util.config.ModelConfig import ModelConfig, PartConfig
from modules.util.enum.DataType import DataType
from modules.util.wan_detection import NotAWanModelError, check_wan_pipeline, detect_variant
from modules.util.safetensors_only import NotSafetensorsError, refuse_pickled_folder


class ModelLoadError(Exception):
    pass


def load_single_file_transformer(path: Path, config: dict, weight_dtype: DataType) -> WanTransformer3DModel:
    """A transformer file in any layout (diffusers, official Wan, ComfyUI, fp8 / fp8_scaled) with `config` giving
    the head count (checked against the file's shapes): built on the meta device, filled one tensor at a time."""
    from modules.modelLoader.wan.parts.recognise import find_parts
    from modules.modelLoader.wan.parts.tensor_files import ModelFileError
    from modules.modelLoader.wan.parts.transformer_files import load_transformer
    from modules.modelLoader.wan.parts.wan_configs import transformer_config_from_shapes
    try:
        found = [f for f in find_parts(path) if f.part == "transformer"]
        if not found:
            raise ModelFileError(f"{path}: holds no Wan transformer")
        full_config = transformer_config_from_shapes(found[0].detail.shapes, str(path), config)
        return load_transformer(found[0].files, found[0].detail, full_config, weight_dtype, str(path))
    except ModelFileError as error:
        raise ModelLoadError(str(error)) from None


def load_folder_transformer_fp8(folder: Path) -> WanTransformer3DModel | None:
    """A diffusers transformer folder (full precision) as FLOAT_8, each tensor cast to float8 as it is read from the
    memory-mapped file: from_pretrained in bfloat16 and casting afterwards held the whole model in bfloat16 (and
    the file's pages) beside the float8 copy. The same numbers (read through bfloat16, then float8). None when the
    folder is not one the tensor reader knows (then the caller loads it with from_pretrained)."""
    from modules.modelLoader.wan.parts.recognise import find_parts
    from modules.modelLoader.wan.parts.transformer_files import load_transformer
    found = [f for f in find_parts(folder) if f.part == "transformer" and f.folder is not None and f.config]
    if len(found) != 1 or found[0].layout != "diffusers":
        return None
    return load_transformer(found[0].files, found[0].detail, found[0].config, DataType.FLOAT_8, str(folder))


def load_text_encoder_only(config: ModelConfig) -> UMT5EncoderModel:
    """The text encoder `WanBaseModelLoader().load(config)` reads, alone (read again after it was released)."""
    if uses_parts_loader(config):
        from modules.modelLoader.wan.WanPartsLoader import WanPartsLoader
        return WanPartsLoader._text_encoder(plan_model(config), config.text_encoder)
    base, local_only = WanBaseModelLoader._resolve_base(config)
    return WanBaseModelLoader._load_part(config.text_encoder, base, "text_encoder", UMT5EncoderModel,
                                         dict(local_files_only=local_only, use_safetensors=True))


def load_part_file(path: Path, part: str, dtype: torch.dtype) -> tuple:
    """A VAE, text encoder or image encoder from one file in any layout (docs/formats.md); a tuple (the image encoder
    comes with its processor)."""
    from modules.modelLoader.wan.parts.recognise import find_parts
    from modules.modelLoader.wan.parts.tensor_files import ModelFileError
    try:
        found = [f for f in find_parts(path) if f.part == part]
        if not found:
            raise ModelFileError(f"model.{part}.path: {path} holds no {part.replace('_', ' ')}")
        found = found[0]
        if part == "vae":
            from modules.modelLoader.wan.parts.vae_files import load_vae, vae_config_for
            config = found.config if found.config and found.config.get("_class_name") == "AutoencoderKLWan" else None
            return (load_vae(found.files, found.detail, vae_config_for(found.detail, config), dtype, str(path)),)
        if part == "text_encoder":
            from modules.modelLoader.wan.parts.text_encoder_files import load_text_encoder
            return (load_text_encoder(found.files, found.layout, dtype),)
        from modules.modelLoader.wan.parts.image_encoder_files import load_image_encoder
        return load_image_encoder(found.files, found.layout, dtype)
    except ModelFileError as error:
        raise ModelLoadError(str(error)) from None


def _refuse_pickles(folder: Path, what: str) -> None:
    try:
        refuse_pickled_folder(folder, what)
    except NotSafetensorsError as error:
        raise ModelLoadError(str(error)) from None


class WanBaseModelLoader:
    def load(self, config: ModelConfig) -> WanModel:
        if uses_parts_loader(config):
            from modules.modelLoader.wan.WanPartsLoader import WanPartsLoader
            from modules.modelLoader.wan.parts.tensor_files import ModelFileError
            try:
                return WanPartsLoader().load(config, plan_model(config))
            except ModelFileError as error:
                raise ModelLoadError(str(error)) from None
        base, local_only = self._resolve_base(config)
        try:
            return self._load_diffusers(config, base, local_only)
        except (OSError, HFValidationError) as error:
            if local_only:
                raise
            # offline, an empty cache, a mistyped or gated repository: what huggingface_hub says, in one sentence
            raise ModelLoadError(f"model.base_model_name: cannot fetch the weights of the hub id {base!r}: "
                                 f"{(str(error).splitlines() or [type(error).__name__])[0]} (download it once where "
                                 f"the hub is reachable, or name a local folder)") from None

    def _load_diffusers(self, config: ModelConfig, base: str, local_only: bool) -> WanModel:
        model_index = self._read_json(base, "model_index.json", local_only)
        check_wan_pipeline(model_index, str(base))
        expert_names = [name for name in ("transformer", "transformer_2")
                        if model_index.get(name) and model_index[name][0] is not None]
        if not expert_names:
            raise NotAWanModelError(f"{base}: model_index.json names no transformer")
        transformer_config = self._read_json(base, f"{expert_names[0]}/config.json", local_only)
        vae_config = self._read_json(base, "vae/config.json", local_only)
        variant = detect_variant(model_index, transformer_config, vae_config, str(base))

        # never a pickle: without use_safetensors diffusers falls back to .bin files ("unsafe serialization")
        common = dict(local_files_only=local_only, use_safetensors=True)
        model = WanModel(variant=variant, source=str(base))
        model.tokenizer = AutoTokenizer.from_pretrained(base, subfolder="tokenizer", local_files_only=local_only)
        model.text_encoder = self._load_part(config.text_encoder, base, "text_encoder", UMT5EncoderModel, common)
        model.vae = self._load_part(config.vae, base, "vae", AutoencoderKLWan, common)
        for name in expert_names:
            setattr(model, name, self._load_transformer(getattr(config, name), base, name, common))
        if config.image_encoder.path:
            # the one named, with its own preprocessor (a T2V model gets one for E2V's CLIP pathway)
            model.image_encoder, model.image_processor = self._load_clip(config.image_encoder, config.allow_download)
        elif model_index.get("image_encoder") and model_index["image_encoder"][0] is not None:
            model.image_encoder = self._load_part(config.image_encoder, base, "image_encoder", CLIPVisionModel, common)
            model.image_processor = CLIPImageProcessor.from_pretrained(base, subfolder="image_processor",
                                                                       local_files_only=local_only)
        scheduler_class = getattr(diffusers, model_index["scheduler"][1])
        model.noise_scheduler = scheduler_class.from_pretrained(base, subfolder="scheduler",
                                                                local_files_only=local_only)
        model.sampling_defaults = folder_defaults(model_index, model.noise_scheduler.config)
        model.boundary_ratio = model_index.get("boundary_ratio")
        model.expand_timesteps = bool(model_index.get("expand_timesteps", False))
        for part in model.parts().values():
            part.requires_grad_(False).eval()
        return model

    @staticmethod
    def _load_clip(part: PartConfig, allow_download: bool = False):
        """Any image-encoder form: a file (ComfyUI's clip_vision_h, the official CLIP .pth), a CLIP folder, a
        diffusers model's image_encoder/ or the whole model folder, or, with allow_download, a hub id."""
        from modules.util.config.image_encoder_source import WHAT_WORKS, looks_like_hub_id
        path = Path(part.path)
        dtype = part.weight_dtype.torch_dtype()
        if path.is_file():   # clip_vision_h.safetensors, the official CLIP .pth, an open_clip checkpoint
            return load_part_file(path, "image_encoder", dtype)
        if not path.is_dir() and allow_download and looks_like_hub_id(part.path):
            from modules.modelLoader.wan.hub_image_encoder import load_hub_image_encoder
            return load_hub_image_encoder(part.path, dtype)
        if not path.is_dir():
            raise ModelLoadError(f"model.image_encoder.path (--image_encoder): {part.path!r} does not exist; "
                                 f"{WHAT_WORKS}")
        from modules.modelLoader.wan.parts.image_encoder_files import load_image_encoder_folder
        from modules.modelLoader.wan.parts.tensor_files import ModelFileError
        try:
            return load_image_encoder_folder(path, dtype)
        except ModelFileError as error:
            raise ModelLoadError(str(error)) from None

    @staticmethod
    def _resolve_base(config: ModelConfig) -> tuple[str, bool]:
        name = config.base_model_name
        if not name:
            raise ModelLoadError("model.base_model_name is empty: name a diffusers folder (or a hub id)")
        if Path(name).is_dir():
            return str(Path(name)), True
        if config.allow_download:
            return name, False
        raise ModelLoadError(f"model.base_model_name: {name!r} is not a folder; to fetch a hub id, set "
                             f"model.allow_download to true")

    def _read_json(self, base: str, relative: str, local_only: bool) -> dict:
        path = Path(base) / relative
        if not path.is_file() and not local_only:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import RemoteEntryNotFoundError
            try:
                path = Path(hf_hub_download(base, relative))
            except RemoteEntryNotFoundError:   # the repository has no such file: said below, as for a folder
                pass
            except OSError as error:     # offline and not cached, no such repository, gated, a proxy's refusal
                raise ModelLoadError(
                    f"model.base_model_name {base!r}: {relative} is neither in the Hugging Face cache nor "
                    f"downloadable ({type(error).__name__}: {str(error).splitlines()[0]}). Download the model "
                    f"once where there is a connection (hf download {base} --local-dir DIR) and set "
                    f"model.base_model_name to DIR") from None
        if not path.is_file():
            raise NotAWanModelError(f"{base}: {relative} is missing; this is not a diffusers Wan model folder")
        return json.loads(path.read_text(encoding="utf-8"))

    @staticmethod
    def _load_part(part: PartConfig, base: str, subfolder: str, cls, common: dict):
        dtype = part.weight_dtype.torch_dtype()
        if part.path:
            path = Path(part.path)
            if path.is_file():   # a hub-id base (a local base goes through the parts loader)
                return load_part_file(path, subfolder, dtype)[0]
            if not path.is_dir():
                raise ModelLoadError(f"model.{subfolder}.path: {part.path!r} does not exist")
            if not (path / "config.json").is_file():
                _refuse_pickles(path / subfolder, f"model.{subfolder}.path")
                return cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype, local_files_only=True,
                                           use_safetensors=True)
            _refuse_pickles(path, f"model.{subfolder}.path")
            return cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True, use_safetensors=True)
        _refuse_pickles(Path(base) / subfolder, "model.base_model_name")
        return cls.from_pretrained(base, subfolder=subfolder, torch_dtype=dtype, **common)

    def _load_transformer(self, part: PartConfig, base: str, subfolder: str, common: dict) -> WanTransformer3DModel:
        if part.weight_dtype.is_quantized:
            from modules.modelLoader.wan.parts.tensor_files import ModelFileError
            from modules.modelLoader.wan.quantized_transformer import load_quantized_transformer
            try:
                return load_quantized_transformer(part, base, subfolder, common)
            except ModelFileError as error:
                raise ModelLoadError(str(error)) from None
        if part.path and Path(part.path).is_file():
            config = WanTransformer3DModel.load_config(base, subfolder=subfolder, **common)
            # a hub-id base (a local folder goes through the parts loader): the file's own layout and dtype decide
            return load_single_file_transformer(Path(part.path), config, part.weight_dtype)
        elif part.path and not Path(part.path).exists():
            raise ModelLoadError(f"model.{subfolder}.path: {part.path!r} does not exist")
        else:
            # the class the folder's config names: VACE's blocks, Animate's encoders and adapter would be dropped by
            # the plain class
            config_folder = part.path or base
            sub = None if part.path and (Path(part.path) / "config.json").is_file() else subfolder
            config = WanTransformer3DModel.load_config(config_folder, subfolder=sub, **common)
            folder = Path(config_folder) / (sub or "")
            if part.weight_dtype is DataType.FLOAT_8 and folder.is_dir():
                from modules.modelLoader.wan.parts.tensor_files import ModelFileError
                try:
                    transformer = load_folder_transformer_fp8(folder)
                except ModelFileError as error:
                    raise ModelLoadError(str(error)) from None
                if transformer is not None:   # already float8 (layerwise casting set up as it was read)
                    return transformer
            transformer = self._load_part(part, base, subfolder, transformer_class(config), common)
        if part.weight_dtype is DataType.FLOAT_8:
            # frozen base weights stored in fp8 and upcast per layer for compute: a 14B model fits in 24 GB
            transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        return transformer
