"""Turns a loaded Wan model into an E2V model (DESIGN.md 6.10): an I2V-architecture base trains as it is; a T2V
base is expanded (wider patch embedding, an image branch) so that its output equals the base's at step 0."""
import json

from modules.model.e2v_expansion import expand_t2v_for_e2v, expanded_parameter_names
from modules.model.WanModel import WanModel
from modules.util.config.config_io import ConfigError
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.enum.WanVariant import WanVariant

E2V_TENSOR_PREFIX = "e2v."        # the expanded parts' full tensors, in an E2V LoRA file
E2V_CONFIG_METADATA = "e2v_config"


def prepare_e2v_model(model: WanModel, dataset: E2VDatasetConfig) -> None:
    latent_channels = model.latent_channels
    condition_channels = dataset.condition_channels(latent_channels)
    if dataset.uses_clip and model.image_encoder is None:
        raise ConfigError([f"e2v: e2v_type {dataset.e2v_type!r} uses the CLIP pathway, but the model has no image "
                           f"encoder; set model.image_encoder.path to a CLIP vision model (for example the "
                           f"image_encoder of a Wan 2.1 I2V diffusers folder)"])
    if model.variant.has_two_experts or model.expand_timesteps:
        raise ConfigError([f"e2v: a {model.variant} model is not supported; use a Wan 2.1 T2V or I2V base"])
    in_channels = model.transformer.config.in_channels
    if in_channels == latent_channels:
        image_dim = model.image_encoder.config.hidden_size if dataset.uses_clip else None
        model.transformer = expand_t2v_for_e2v(model.transformer, condition_channels, image_dim)
        model.e2v_trainable = expanded_parameter_names(model.transformer)
    elif in_channels != latent_channels + condition_channels:
        raise ConfigError([f"e2v: the transformer takes {in_channels} input channels; this E2V layout needs "
                           f"{latent_channels + condition_channels} (noise {latent_channels} + condition "
                           f"{condition_channels}) or a T2V base ({latent_channels}) to expand"])
    if dataset.uses_clip and model.transformer.config.image_dim is None:
        raise ConfigError(["e2v: the CLIP pathway needs a transformer with an image branch (image_dim)"])
    model.variant = WanVariant.I2V
    model.e2v_config = dataset


def e2v_config_metadata(dataset: E2VDatasetConfig) -> str:
    return json.dumps(dataset.model_dump(mode="json", exclude={"data_root", "visualization"}))
