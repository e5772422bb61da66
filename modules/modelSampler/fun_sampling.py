"""A Wan-Fun Control sample's inputs: the control video (and for Wan2.2-Fun Control A14B the mask video) read as VACE
samples read theirs (vace_sampling.py), the start image (`image`), made into the condition with the shared code
(modules/model/fun_condition.py) as training makes it, and the CLIP tokens of the start image; without one, zero CLIP
features, as VideoX-Fun's `pipeline_wan_fun_control.py` passes them (`clip_context = torch.zeros_like(...)`)."""
import numpy as np
import torch
from PIL import Image

from modules.model.fun_condition import fun_control_a14b_condition, fun_control_condition
from modules.model.vace_condition import image_to_tensor, model_encoder
from modules.modelSampler.vace_sampling import load_vace_inputs


def fun_condition(model, sample, start: Image.Image | None) -> torch.Tensor:
    """(32 or 36, T, h, w) for a resolved sample (the VAE must be placed); `start`: the start image at the sample's
    size or None."""
    control, mask, _ = load_vace_inputs(sample.control_video, sample.mask_video, [], sample.frames, sample.height,
                                        sample.width)
    start_tensor = image_to_tensor(start) if start is not None else None
    encode = model_encoder(model)
    with torch.no_grad():
        if model.variant.fun_condition_channels == 32:
            return fun_control_condition(encode, control, start_tensor, sample.frames, sample.height, sample.width)
        video = torch.zeros(3, sample.frames, sample.height, sample.width)
        if start_tensor is not None:   # the start image kept in frame 0, the rest generated
            video[:, 0] = start_tensor
            if mask is None:
                mask = torch.ones(1, sample.frames, sample.height, sample.width)
                mask[:, 0] = 0
        return fun_control_a14b_condition(encode, control, video, mask, sample.frames, sample.height, sample.width)


def fun_image_embeds(model, start: Image.Image | None) -> torch.Tensor | None:
    """CLIP tokens (tokens, dim) of the start image, zeros of that shape without one; None for a model without CLIP."""
    if model.image_encoder is None:
        return None
    with torch.no_grad():
        if start is not None:
            return model.encode_image([np.array(start)])[0]
        return torch.zeros_like(model.encode_image([np.zeros((512, 512, 3), np.uint8)])[0])


def fun_inputs(model, sample, start: Image.Image | None, placement, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the condition on `device`, the CLIP tokens) with the VAE (and CLIP) placed by the sampler's `placement`."""
    with placement.using("vae", *(("image_encoder",) if model.image_encoder is not None else ())):
        return fun_condition(model, sample, start).to(device), fun_image_embeds(model, start)
