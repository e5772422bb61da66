"""Builds a WanModel from a `ModelPlan` (modules/modelLoader/wan/parts/model_plan.py): each part from a diffusers
folder (from_pretrained) or from single files in the official Wan / ComfyUI layouts, read one tensor at a time
into a meta-built model."""
import logging

import diffusers
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from transformers import UMT5EncoderModel

from modules.model.WanModel import WanModel
from modules.model.transformer_classes import transformer_class
from modules.modelLoader.wan.parts.model_plan import ModelPlan
from modules.modelLoader.wan.parts.recognise import FoundPart
from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.modelLoader.wan.parts.tokenizer_files import load_tokenizer
from modules.modelLoader.wan.parts.transformer_files import load_transformer
from modules.modelLoader.wan.parts.vae_files import load_vae, vae_config_for
from modules.util.config.ModelConfig import ModelConfig, PartConfig
from modules.util.enum.DataType import DataType

logger = logging.getLogger(__name__)


def _from_folder(cls, found: FoundPart, dtype: torch.dtype):
    return cls.from_pretrained(found.folder, torch_dtype=dtype, local_files_only=True, use_safetensors=True)


def model_source(plan: ModelPlan, base: str) -> str:
    """An identity for caches: the base and the files every part came from."""
    parts = ";".join(f"{name}={','.join(str(f) for f in found.files)}" for name, found in sorted(plan.parts.items()))
    return f"{base}|{parts}"


class WanPartsLoader:
    def load(self, config: ModelConfig, plan: ModelPlan) -> WanModel:
        for message in plan.messages:
            logger.info(message)
        model = WanModel(variant=plan.variant, source=model_source(plan, config.base_model_name),
                         part_messages=list(plan.messages))
        model.tokenizer = load_tokenizer(plan, config)   # first: a missing tokenizer costs no weight reads
        model.part_messages.append(f"tokenizer: {getattr(model.tokenizer, 'name_or_path', '') or 'found'} "
                                   f"({type(model.tokenizer).__name__}, {len(model.tokenizer)} tokens)")
        for name in ("transformer", "transformer_2"):
            if name in plan.parts:
                setattr(model, name, self._transformer(plan, name, getattr(config, name)))
        model.vae = self._vae(plan, config.vae)
        model.text_encoder = self._text_encoder(plan, config.text_encoder)
        if "image_encoder" in plan.parts or plan.hub_image_encoder:
            model.image_encoder, model.image_processor = self._image_encoder(plan, config.image_encoder)
        scheduler_class = getattr(diffusers, plan.scheduler_config.get("_class_name", "UniPCMultistepScheduler"))
        model.noise_scheduler = scheduler_class.from_config(plan.scheduler_config)
        model.boundary_ratio = plan.model_index.get("boundary_ratio")
        model.sampling_defaults = plan.sampling_defaults
        model.expand_timesteps = bool(plan.model_index.get("expand_timesteps", False))
        for part in model.parts().values():
            part.requires_grad_(False).eval()
        return model

    @staticmethod
    def _transformer(plan: ModelPlan, name: str, part: PartConfig) -> WanTransformer3DModel:
        found = plan.parts[name]
        source = str(found.folder or found.files[0])
        if part.weight_dtype.is_quantized:
            if found.folder is None or found.layout != "diffusers":
                raise ModelFileError(f"{plan.origins[name]}: {part.weight_dtype} weights load from a diffusers "
                                     f"folder, not from {source} ({found.layout}); use FLOAT_8 for single files")
            from modules.modelLoader.wan.quantized_transformer import load_quantized_transformer
            return load_quantized_transformer(part.model_copy(update={"path": str(found.folder)}))
        if found.folder is not None and not found.dtype.startswith("fp8") and part.weight_dtype is DataType.FLOAT_8:
            # cast to float8 as each tensor is read (never the whole model in bfloat16 beside it)
            return load_transformer(found.files, found.detail, plan.transformer_configs[name], part.weight_dtype,
                                    source)
        if found.folder is not None and not found.dtype.startswith("fp8"):
            return _from_folder(transformer_class(found.config or {}), found, part.weight_dtype.torch_dtype())
        return load_transformer(found.files, found.detail, plan.transformer_configs[name], part.weight_dtype, source)

    @staticmethod
    def _vae(plan: ModelPlan, part: PartConfig) -> AutoencoderKLWan:
        found = plan.parts["vae"]
        dtype = part.weight_dtype.torch_dtype()
        if found.folder is not None:
            return _from_folder(AutoencoderKLWan, found, dtype)
        # plan.vae_config: a VAE config.json beside the file or the diffusers base's; else the released VAE's
        config = plan.vae_config or vae_config_for(found.detail, None)
        return load_vae(found.files, found.detail, config, dtype, str(found.files[0]))

    @staticmethod
    def _text_encoder(plan: ModelPlan, part: PartConfig) -> UMT5EncoderModel:
        found = plan.parts["text_encoder"]
        if found.folder is not None:
            return _from_folder(UMT5EncoderModel, found, part.weight_dtype.torch_dtype())
        from modules.modelLoader.wan.parts.text_encoder_files import load_text_encoder
        return load_text_encoder(found.files, found.layout, part.weight_dtype.torch_dtype())

    @staticmethod
    def _image_encoder(plan: ModelPlan, part: PartConfig):
        dtype = part.weight_dtype.torch_dtype()
        if plan.hub_image_encoder:
            from modules.modelLoader.wan.hub_image_encoder import load_hub_image_encoder
            return load_hub_image_encoder(plan.hub_image_encoder, dtype)
        found = plan.parts["image_encoder"]
        if found.folder is not None:
            from modules.modelLoader.wan.parts.image_encoder_files import load_image_encoder_folder
            return load_image_encoder_folder(found.folder, dtype)
        from modules.modelLoader.wan.parts.image_encoder_files import load_image_encoder
        return load_image_encoder(found.files, found.layout, dtype)
