"""An image encoder named by hub id (`train --image_encoder Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`): a diffusers
repository's image_encoder/ and image_processor/ subfolders, or a CLIP vision repository itself."""
from transformers import CLIPImageProcessor, CLIPVisionModel


def load_hub_image_encoder(repo_id: str, dtype) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """The repository's own preprocessor where it has one, else Wan's own CLIP preprocessing."""
    from modules.modelLoader.wan.parts.image_encoder_files import wan_clip_processor
    try:
        encoder = CLIPVisionModel.from_pretrained(repo_id, subfolder="image_encoder", torch_dtype=dtype,
                                                  use_safetensors=True)
        processor_places = ({"subfolder": "image_processor"}, {"subfolder": "image_encoder"})
    except OSError:  # no image_encoder/ in the repository: a CLIP vision repository itself
        encoder = CLIPVisionModel.from_pretrained(repo_id, torch_dtype=dtype, use_safetensors=True)
        processor_places = ({},)
    for place in processor_places:
        try:
            return encoder, CLIPImageProcessor.from_pretrained(repo_id, **place)
        except OSError:   # the repository has no preprocessor_config.json there
            continue
    return encoder, wan_clip_processor(encoder.config.image_size)
