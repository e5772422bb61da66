"""An image encoder named by hub id (`train --image_encoder Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`): a diffusers
repository's image_encoder/ and image_processor/ subfolders, or a CLIP vision repository itself."""
from transformers import CLIPImageProcessor, CLIPVisionModel


def load_hub_image_encoder(repo_id: str, dtype) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    try:
        encoder = CLIPVisionModel.from_pretrained(repo_id, subfolder="image_encoder", torch_dtype=dtype,
                                                  use_safetensors=True)
    except OSError:  # no image_encoder/ in the repository: a CLIP vision repository itself
        return (CLIPVisionModel.from_pretrained(repo_id, torch_dtype=dtype, use_safetensors=True),
                CLIPImageProcessor.from_pretrained(repo_id))
    return encoder, CLIPImageProcessor.from_pretrained(repo_id, subfolder="image_processor")
