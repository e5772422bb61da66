"""Wan-Fun files (aigc-apps/VideoX-Fun, videox_fun/models/wan_transformer3d.py `WanTransformer3DModel`): the official
Wan names, with the condition channels in `patch_embedding` (48 / 52 / 36 input channels: see
modules/util/wan_detection.py `fun_variant`), so a Fun-Control or InP transformer loads as a diffusers
`WanTransformer3DModel` of that width. Two optional modules of VideoX-Fun's class have no diffusers counterpart:

- `ref_conv` (`add_ref_conv`, Wan2.1-Fun V1.1 Control): a Conv2d that makes the reference image one more token
  sequence, prepended to the video tokens in self-attention (`full_ref`, forward lines `if self.ref_conv is not None
  and full_ref is not None`);
- `control_adapter` (`add_control_adapter`, Fun Control-Camera): a `SimpleAdapter` adding camera-pose features to the
  patch embedding.

Loading either as a plain transformer would silently drop what the model was trained with, so they are refused,
naming the tensors."""
from modules.modelLoader.wan.parts.tensor_files import ModelFileError

_UNSUPPORTED = {"ref_conv.": "a Wan2.1-Fun V1.1 reference convolution (the reference image as extra self-attention "
                             "tokens, VideoX-Fun's add_ref_conv)",
                "control_adapter.": "a Wan-Fun Control-Camera adapter (camera poses added to the patch embedding, "
                                    "VideoX-Fun's add_control_adapter)"}


def refuse_unsupported_fun(keys, source: str) -> None:
    """Raises ModelFileError when the transformer holds a Wan-Fun module diffusers' WanTransformer3DModel lacks."""
    for prefix, what in _UNSUPPORTED.items():
        found = sorted(k for k in keys if k.startswith(prefix))
        if found:
            raise ModelFileError(f"{source}: holds {what}: tensors {', '.join(found)}. diffusers' "
                                 f"WanTransformer3DModel has no such module, so this trainer cannot run the model as "
                                 f"it was trained; use a Wan-Fun release without it (Wan2.1-Fun V1.0 Control / InP, "
                                 f"Wan2.2-Fun Control A14B)")
