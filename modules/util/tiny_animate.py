"""Tiny random Wan2.2-Animate and Animate-2 models (DESIGN.md sections 8 and 11), saved as diffusers folders with the
released classes: `WanAnimatePipeline` with `WanAnimateTransformer3DModel`; for Animate-2 (whose pipeline is
diffusers' modular `WanAnimate2ModularPipeline`) the same parts with `WanAnimate2Transformer3DModel`.

Animate puts a face adapter after every 5th block (the official `FaceAdapter(num_adapter_layers=num_layers // 5)`),
so the tiny model has 5 blocks. Its motion encoder reads 16x16 face crops (512x512 in the release): the official
`Generator` halves the side once per residual block down to 4x4, so 16 px gives two residual blocks.
Animate-2's image projection is fixed at 1280 inputs (`MLPProj(1280, dim)`), so its CLIP is 1280 wide (one layer),
and its pipeline resizes every image to 224x224 for CLIP (`clip_visual_encode`), so the CLIP reads 224 px in 14 px
patches (257 tokens, as ViT-H/14).
"""
import json
from pathlib import Path

import torch

from modules.util import tiny_models as tm

ANIMATE_VARIANTS = ("wan2.2-animate", "wan2.2-animate-2")
ANIMATE_LAYERS = 5                 # one face adapter block (after block 0)
FACE_SIZE = 16                     # face crop side in pixels (512 in the release)
MOTION_CHANNELS = {"16": 8, "8": 12, "4": 16}   # the motion encoder's widths per side (all different)
MOTION_STYLE_DIM = 20
MOTION_DIM = 4
MOTION_ENCODER_DIM = 28
FACE_HIDDEN = 16
FACE_HEADS = 2
FLOW_SHIFT_ANIMATE = 5.0           # sample_shift of the official wan/configs/wan_animate_14B.py
ANIMATE_2_CLIP_HIDDEN = 1280
# the pipeline resizes every CLIP input to 224 x 224 itself (encoders.clip_visual_encode); 32 px patches: 50 tokens
ANIMATE_2_CLIP_IMAGE_SIZE = 224
ANIMATE_2_CLIP_PATCH_SIZE = 32
ANIMATE_2_PIPELINE = "WanAnimate2ModularPipeline"


def animate_transformer_config() -> dict:
    return dict(
        patch_size=(1, 2, 2), num_attention_heads=tm.NUM_HEADS, attention_head_dim=tm.HEAD_DIM, in_channels=36,
        latent_channels=16, out_channels=16, text_dim=tm.TEXT_DIM, freq_dim=256, ffn_dim=tm.FFN_DIM,
        num_layers=ANIMATE_LAYERS, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        image_dim=tm.CLIP_HIDDEN, added_kv_proj_dim=tm.INNER_DIM, rope_max_seq_len=1024, pos_embed_seq_len=None,
        motion_encoder_channel_sizes=dict(MOTION_CHANNELS), motion_encoder_size=FACE_SIZE,
        motion_style_dim=MOTION_STYLE_DIM, motion_dim=MOTION_DIM, motion_encoder_dim=MOTION_ENCODER_DIM,
        face_encoder_hidden_dim=FACE_HIDDEN, face_encoder_num_heads=FACE_HEADS, inject_face_latents_blocks=5,
        motion_encoder_batch_size=8)


def animate_2_transformer_config() -> dict:
    return dict(patch_size=(1, 2, 2), text_len=512, in_dim=36, dim=tm.INNER_DIM, ffn_dim=tm.FFN_DIM, freq_dim=256,
                text_dim=tm.TEXT_DIM, out_dim=16, num_heads=tm.NUM_HEADS, num_layers=2, cross_attn_norm=True,
                eps=1e-6, use_img_emb=True, refer_offset_t=1, refer_offset_h=0, refer_offset_w=-1, refer_stride=1)


def make_animate_transformer(seed: int, animate_2: bool = False):
    from diffusers import WanAnimate2Transformer3DModel, WanAnimateTransformer3DModel

    torch.manual_seed(tm.part_seed(seed, "transformer"))
    if animate_2:
        return WanAnimate2Transformer3DModel(**animate_2_transformer_config()).eval()
    model = WanAnimateTransformer3DModel(**animate_transformer_config()).eval()
    with torch.no_grad():
        # diffusers initialises the motion encoder's synthesis directions with randn and its fused biases with 0;
        # random biases make a motion code that depends on more than the first layer's sign pattern
        for name, parameter in model.named_parameters():
            if name.startswith("motion_encoder.") and name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    return model


def _animate_2_image_encoder(seed: int):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=ANIMATE_2_CLIP_HIDDEN, intermediate_size=64, projection_dim=64,
                              num_hidden_layers=1, num_attention_heads=2, num_channels=3,
                              image_size=ANIMATE_2_CLIP_IMAGE_SIZE, patch_size=ANIMATE_2_CLIP_PATCH_SIZE,
                              hidden_act="gelu",
                              layer_norm_eps=1e-5)
    torch.manual_seed(tm.part_seed(seed, "image_encoder"))
    return CLIPVisionModel(config).eval()


def _parts(variant: str, seed: int) -> dict:
    spec = tm.SPECS["wan2.1-i2v"]   # the Wan 2.1 VAE, UMT5 and CLIP of the I2V models
    tokenizer = tm.make_tokenizer()
    animate_2 = variant == "wan2.2-animate-2"
    scheduler = tm.make_scheduler(spec)
    scheduler.register_to_config(flow_shift=FLOW_SHIFT_ANIMATE)
    return dict(tokenizer=tokenizer, text_encoder=tm.make_text_encoder(len(tokenizer), seed),
                vae=tm.make_vae(spec, seed), scheduler=scheduler,
                image_encoder=_animate_2_image_encoder(seed) if animate_2 else tm.make_image_encoder(seed),
                image_processor=tm.make_image_processor(),
                transformer=make_animate_transformer(seed, animate_2))


def make_animate_pipeline(variant: str, seed: int = 0):
    """`WanAnimatePipeline` of tiny parts (Animate); for Animate-2 the parts as a dict (its pipeline is modular)."""
    from diffusers import WanAnimatePipeline

    parts = _parts(variant, seed)
    return parts if variant == "wan2.2-animate-2" else WanAnimatePipeline(**parts)


def save_animate_2(parts: dict, folder: Path) -> None:
    """The parts in diffusers' folder layout with a model_index.json naming the modular pipeline and the classes."""
    index = {"_class_name": ANIMATE_2_PIPELINE, "_diffusers_version": "0.42.1"}
    for name, part in parts.items():
        part.save_pretrained(folder / name, **({} if name in ("tokenizer", "image_processor", "scheduler")
                                               else dict(safe_serialization=True)))
        library = "transformers" if type(part).__module__.startswith("transformers") else "diffusers"
        index[name] = [library, type(part).__name__]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def animate_2_modular_pipeline(model, scheduler, distilled: bool = False):
    """diffusers' `WanAnimate2ModularPipeline` (or the distilled one) over a loaded Animate-2 `WanModel`'s parts: the
    reference our Animate-2 conditioning and sampler are tested against. `scheduler` must take `generator` in its
    `step` (the pipeline passes one): FlowMatchEulerDiscreteScheduler."""
    from diffusers.modular_pipelines import WanAnimate2Blocks, WanAnimate2DistilledBlocks

    pipe = (WanAnimate2DistilledBlocks() if distilled else WanAnimate2Blocks()).init_pipeline()
    pipe.update_components(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                           image_encoder=model.image_encoder, transformer=model.transformer, scheduler=scheduler)
    return pipe
