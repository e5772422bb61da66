from enum import Enum


class ModelFormat(str, Enum):
    DIFFUSERS = "DIFFUSERS"            # a diffusers folder
    ORIGINAL = "ORIGINAL"              # one safetensors transformer file with the official Wan key names
    ORIGINAL_FP8_SCALED = "ORIGINAL_FP8_SCALED"  # ORIGINAL as ComfyUI's *_fp8_scaled files: float8 + scale_weight
    COMFY_LORA = "COMFY_LORA"          # diffusion_model.<original name>.lora_A/lora_B/alpha
    KOHYA_LORA = "KOHYA_LORA"          # lora_unet_<original name, dots as _>.lora_down/lora_up/alpha
    DIFFUSERS_LORA = "DIFFUSERS_LORA"  # transformer.<diffusers name>.lora_A/lora_B
    SAFETENSORS = "SAFETENSORS"        # embeddings: a plain safetensors file

    def __str__(self) -> str:
        return self.value

    @property
    def is_lora(self) -> bool:
        return self.name.endswith("_LORA")
