"""The diffusers transformer class a config names: Wan's own (`WanTransformer3DModel`) or a derivative's (VACE's
`WanVACETransformer3DModel`, Animate's `WanAnimateTransformer3DModel`, Animate-2's `WanAnimate2Transformer3DModel`).
Loading a derivative's weights into the plain class would drop its extra modules, so every loader picks the class here
from the config's `_class_name`."""
from diffusers import (WanAnimate2Transformer3DModel, WanAnimateTransformer3DModel, WanTransformer3DModel,
                       WanVACETransformer3DModel)

TRANSFORMER_CLASSES = {cls.__name__: cls for cls in (WanTransformer3DModel, WanVACETransformer3DModel,
                                                     WanAnimateTransformer3DModel, WanAnimate2Transformer3DModel)}


def transformer_class(config: dict) -> type:
    """The class for `config` (a diffusers transformer config.json); a config without `_class_name` is Wan's own."""
    name = config.get("_class_name") or "WanTransformer3DModel"
    if name not in TRANSFORMER_CLASSES:
        raise ValueError(f"transformer class {name!r} is not a Wan transformer ({', '.join(TRANSFORMER_CLASSES)})")
    return TRANSFORMER_CLASSES[name]

