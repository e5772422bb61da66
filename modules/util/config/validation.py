"""Checks that need the file system (paths exist, files parse); run after the schema, before any model loads."""
from pathlib import Path

from modules.util.config.config_io import ConfigError
from modules.util.config.TrainConfig import TrainConfig
from modules.util.safetensors_only import NotSafetensorsError, require_safetensors


def check_paths(config: TrainConfig) -> None:
    problems = []
    base = config.model.base_model_name
    if not base:
        problems.append("model.base_model_name: required, but empty (a diffusers folder, or a hub id)")
    elif not Path(base).is_dir() and not config.model.allow_download:
        problems.append(f"model.base_model_name: {base!r} is not a folder; a hub id needs model.allow_download=true")
    for part in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder"):
        path = getattr(config.model, part).path
        if path and not Path(path).exists():
            problems.append(f"model.{part}.path: {path!r} does not exist")
    for index, concept in enumerate(config.data.concepts):
        if concept.enabled and not Path(concept.path).exists():
            problems.append(f"data.concepts.{index}.path: {concept.path!r} does not exist")
        if concept.caption_source == "prompt_file" and not Path(concept.prompt_path).is_file():
            problems.append(f"data.concepts.{index}.prompt_path: {concept.prompt_path!r} is not a file "
                            f"(caption_source is 'prompt_file')")
    if config.sampling.samples_file and not Path(config.sampling.samples_file).is_file():
        problems.append(f"sampling.samples_file: {config.sampling.samples_file!r} does not exist")
    if config.lora.init_from and not Path(config.lora.init_from).is_file():
        problems.append(f"lora.init_from: {config.lora.init_from!r} does not exist")
    weight_files = [("lora.init_from", config.lora.init_from)] + [
        (f"model.{part}.path", getattr(config.model, part).path) for part in ("transformer", "transformer_2")]
    for field, path in weight_files:
        if path and not Path(path).is_dir():
            try:
                require_safetensors(path, field)
            except NotSafetensorsError as error:
                problems.append(str(error))
    allowed = {"LORA": ["COMFY_LORA", "KOHYA_LORA", "DIFFUSERS_LORA"], "FINE_TUNE": ["DIFFUSERS", "ORIGINAL"],
               "EMBEDDING": ["SAFETENSORS"]}[config.training_method.value]
    if config.output.format.value not in allowed:
        problems.append(f"output.format: {config.output.format.value!r} cannot hold a {config.training_method.value} "
                        f"result; allowed: {', '.join(allowed)}")
    if config.training_method.value == "LORA" and config.lora.type != "LORA" \
            and config.output.format.value == "DIFFUSERS_LORA":
        problems.append(f"output.format: DIFFUSERS_LORA has no key names for {config.lora.type} (lora.type); "
                        f"use COMFY_LORA or KOHYA_LORA")
    destination = Path(config.output.destination)
    if config.output.format.value != "DIFFUSERS" and destination.is_dir():
        problems.append(f"output.destination: {str(destination)!r} is an existing folder; {config.output.format.value} "
                        f"writes a file: name the file (e.g. {str(destination / 'lora.safetensors')!r})")
    if problems:
        raise ConfigError(problems)
