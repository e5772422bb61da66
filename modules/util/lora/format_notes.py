"""What the consumers of a LoRA file will do with it, said once when training saves it and again in the run's
summary (docs/formats.md, "Known refusals and differences", has the table)."""


def format_notes(training_method: str, output_format: str, lora_type: str = "LORA", dora: bool = False,
                 targets: str = "") -> list[str]:
    """The notes for a result of `training_method` written as `output_format` (the enums' values)."""
    if training_method != "LORA":
        return []
    notes = []
    if output_format == "DIFFUSERS_LORA":
        notes.append("DIFFUSERS_LORA: ComfyUI's LoRA loader recognises none of its transformer.* keys (0 of 860 for "
                     "a Wan 2.1 1.3B LoRA) and ignores the file; for ComfyUI use COMFY_LORA "
                     "(convert_model --training-method LORA --output-model-format COMFY_LORA converts this one)")
    if dora and output_format in ("COMFY_LORA", "KOHYA_LORA"):
        notes.append(f"DoRA in {output_format}: ComfyUI applies .dora_scale with another formula than training (it "
                     f"divides the magnitude by the norm of the base weight, DoRA by that of base + delta), so its "
                     f"result can be up to about 30 % of the delta off (measured); for the trained "
                     f"model exactly, merge the LoRA into the base: convert_model --merge-lora FILE "
                     f"--base-model-name BASE --output-model-format ORIGINAL --output-model-destination OUT")
    if lora_type in ("LOHA", "LOKR") and output_format in ("COMFY_LORA", "KOHYA_LORA"):
        notes.append(f"{lora_type} in {output_format}: diffusers' load_lora_weights refuses LyCORIS keys (it reads "
                     f"lora_A / lora_B only); ComfyUI loads the file; for diffusers, merge it into the base "
                     f"(convert_model --merge-lora FILE --base-model-name BASE --output-model-format DIFFUSERS)")
    if targets == "vace" and lora_type == "LORA" and output_format in ("COMFY_LORA", "KOHYA_LORA"):
        notes.append(f"VACE blocks in {output_format}: ComfyUI loads the file; diffusers' load_lora_weights reads Wan "
                     f"LoRAs in the original names only for the base blocks (it finds no `blocks.N` and stops), so the "
                     f"same weights are also written beside it as <name>.diffusers.safetensors (DIFFUSERS_LORA) for "
                     f"WanVACEPipeline.load_lora_weights")
    return notes


def config_format_notes(config) -> list[str]:
    """format_notes of a TrainConfig."""
    return format_notes(config.training_method.value, config.output.format.value, config.lora.type,
                        bool(config.lora.dora), config.lora.targets)
