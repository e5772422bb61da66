"""Tiny random Wan models, built from configs and saved as real diffusers folders (DESIGN.md section 8).

No weights can be downloaded in tests, so every part is constructed from a config shaped like the released
Wan 2.1 / 2.2 Diffusers repositories (same classes, same config fields, same pipeline classes and model_index keys),
only with tiny widths: the real code paths (diffusers pipelines, our loaders, trainers and samplers) run on them
in seconds on a CPU. The same recipe makes the demo model (`scripts/make_tiny_model.py`).

Deterministic: the same variant and seed give byte-identical weight files.
"""
import hashlib
import itertools
import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.util.atomic import atomic_dir

VARIANTS = ("wan2.1-t2v", "wan2.1-i2v", "wan2.1-flf2v", "wan2.2-ti2v-5b", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b")

# --- sizes of the tiny parts -----------------------------------------------------------------------------------

TEXT_DIM = 32            # UMT5 d_model == transformer text_dim
NUM_HEADS = 2
HEAD_DIM = 16            # rope splits it 8 (t) / 4 (h) / 4 (w), like 128 -> 44 / 42 / 42 in the real models
INNER_DIM = NUM_HEADS * HEAD_DIM
FFN_DIM = 64
NUM_LAYERS = 2

CLIP_IMAGE_SIZE = 32
CLIP_PATCH_SIZE = 8
CLIP_HIDDEN = 32
CLIP_TOKENS = (CLIP_IMAGE_SIZE // CLIP_PATCH_SIZE) ** 2 + 1   # 17 (257 for ViT-H/14 at 224)

VAE21_BASE_DIM = 8
VAE22_BASE_DIM = 8
VAE22_DECODER_BASE_DIM = 16   # the real Wan 2.2 VAE decodes wider than it encodes (256 vs 160)

TOKENIZER_VOCAB_SIZE = 512    # the trainer's target; the trained vocabulary is smaller on this corpus

# UniPC flow-matching scheduler as diffusers' convert_wan_to_diffusers.py configures the released repos.
FLOW_SHIFT_DEFAULT = 3.0
FLOW_SHIFT_FLF2V = 16.0
FLOW_SHIFT_TI2V = 5.0


@dataclass(frozen=True)
class TinyVariant:
    name: str
    pipeline_class: str          # the diffusers pipeline the released model_index.json names
    in_channels: int             # transformer input channels
    z_dim: int                   # VAE latent channels (16 or 48)
    image_branch: bool           # CLIP image encoder + transformer image_dim / added_kv_proj_dim
    flf2v: bool                  # two CLIP images with a learned position embedding
    two_experts: bool            # transformer (high noise) + transformer_2 (low noise)
    boundary_ratio: float | None
    expand_timesteps: bool
    flow_shift: float


SPECS = {
    "wan2.1-t2v": TinyVariant("wan2.1-t2v", "WanPipeline", 16, 16, False, False, False, None, False,
                              FLOW_SHIFT_DEFAULT),
    "wan2.1-i2v": TinyVariant("wan2.1-i2v", "WanImageToVideoPipeline", 36, 16, True, False, False, None, False,
                              FLOW_SHIFT_DEFAULT),
    "wan2.1-flf2v": TinyVariant("wan2.1-flf2v", "WanImageToVideoPipeline", 36, 16, True, True, False, None, False,
                                FLOW_SHIFT_FLF2V),
    "wan2.2-ti2v-5b": TinyVariant("wan2.2-ti2v-5b", "WanPipeline", 48, 48, False, False, False, None, True,
                                  FLOW_SHIFT_TI2V),
    "wan2.2-t2v-a14b": TinyVariant("wan2.2-t2v-a14b", "WanPipeline", 16, 16, False, False, True, 0.875, False,
                                   FLOW_SHIFT_DEFAULT),
    "wan2.2-i2v-a14b": TinyVariant("wan2.2-i2v-a14b", "WanImageToVideoPipeline", 36, 16, False, False, True, 0.9,
                                   False, FLOW_SHIFT_DEFAULT),
}
assert tuple(SPECS) == VARIANTS


def part_seed(seed: int, part: str) -> int:
    """A seed per (model seed, part): parts never share random streams, and no two model seeds collide."""
    return int.from_bytes(hashlib.sha256(f"wan-tiny:{seed}:{part}".encode()).digest()[:8], "little") % (2**63)


# --- tokenizer -------------------------------------------------------------------------------------------------

_WORDS = """
a an the of in on at to and with from into over under onto through across around behind near
is are was be being it its this that there
video clip frame frames scene image picture shot camera view close closeup wide
square circle ball box cube dot shape triangle star ring line stripe
person man woman boy girl face hand cat dog bird fish horse car bus boat train tree flower house
road street room table chair wall floor window door sky cloud sun moon water sea river grass field
background foreground object element reference subject
red green blue yellow orange purple pink black white grey gray brown cyan magenta gold silver colour color
left right up down top bottom center centre middle corner side edge
moving moves move motion slowly quickly fast slow still static walking running flying jumping turning
rotating spinning falling rising sliding bouncing zooming panning
small large big tiny huge bright dark light soft sharp blurry high low quality detailed
one two three four five first last next
""".split()
_COLOURS = ("red", "green", "blue", "yellow")
_DIRECTIONS = ("left", "right", "up", "down")
_OBJECTS = ("square", "circle", "ball")
_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]   # ids 0, 1, 2 as in (U)MT5


def tokenizer_corpus() -> list[str]:
    """The built-in training text: captions of the synthetic data, plus each word alone and with a few suffixes.

    The suffixed forms matter: the Unigram trainer seeds its pieces from repeated substrings that are followed by
    different continuations, so a word that is only ever followed by a word boundary would never become a piece.
    """
    corpus = [f"a {c} {o} moving {d}" for c, o, d in itertools.product(_COLOURS, _OBJECTS, _DIRECTIONS)]
    corpus += [f"the video of a {c} {o} moving {d}" for c, o, d in itertools.product(_COLOURS, _OBJECTS, _DIRECTIONS)]
    for word in _WORDS:
        corpus += [word] * 8 + [word + "s", word + "ed", word + "ing", "un" + word]
    return corpus


def make_tokenizer():
    """A Unigram tokenizer trained with `tokenizers` on the built-in corpus, wrapped as T5TokenizerFast.

    Same layout as the UMT5 tokenizer: <pad> 0, </s> 1, <unk> 2, SentencePiece-style "▁" word prefixes, </s>
    appended. Every ASCII letter, digit and punctuation mark is in the vocabulary, so ASCII text never hits <unk>.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    backend = Tokenizer(models.Unigram())
    # the pre-tokenization T5TokenizerFast itself applies, so the pieces learned here are the ones it can produce
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    trainer = trainers.UnigramTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        unk_token="<unk>",
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
        max_piece_length=16,
        show_progress=False,
    )
    backend.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    vocab = [(piece, float(score)) for piece, score in json.loads(backend.to_str())["model"]["vocab"]]
    if [piece for piece, _ in vocab[:3]] != _SPECIAL_TOKENS:
        raise RuntimeError(f"tokenizer training put {vocab[:3]} first, expected {_SPECIAL_TOKENS}")
    # T5TokenizerFast builds its backend from (piece, score) pairs, exactly as it does again when loading the saved
    # tokenizer.json, so the saved and the loaded tokenizer are the same. No sentinel <extra_id_N> tokens.
    return T5TokenizerFast(vocab=vocab, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)


# --- model parts -----------------------------------------------------------------------------------------------

def make_text_encoder(vocab_size: int, seed: int):
    """UMT5 encoder shaped like umt5-xxl (gated-gelu, relative attention, untied embeddings), d_model 32."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.1,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(part_seed(seed, "text_encoder"))
    return UMT5EncoderModel(config).eval()


def make_image_encoder(seed: int):
    """CLIP ViT shaped like ViT-H/14 but 32x32 pixels, 8x8 patches (17 tokens), hidden 32, two layers."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        projection_dim=CLIP_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_channels=3,
        image_size=CLIP_IMAGE_SIZE,
        patch_size=CLIP_PATCH_SIZE,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    torch.manual_seed(part_seed(seed, "image_encoder"))
    return CLIPVisionModel(config).eval()


def make_image_processor():
    """CLIPImageProcessor as in the released Wan I2V repos (resize shortest edge, centre crop, OpenAI mean/std)."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": CLIP_IMAGE_SIZE},
        resample=3,
        do_center_crop=True,
        crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        do_convert_rgb=True,
    )


def vae_config(spec: TinyVariant) -> dict:
    if spec.z_dim == 48:
        # shaped like the Wan 2.2 VAE: residual blocks, 2x2 pixel patchify (12 channels), stride 4 x 16 x 16
        return dict(base_dim=VAE22_BASE_DIM, decoder_base_dim=VAE22_DECODER_BASE_DIM, z_dim=48, dim_mult=[1, 2, 4, 4],
                    num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
                    is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
                    scale_factor_spatial=16)
    # shaped like the Wan 2.1 VAE (used by every Wan 2.1 model and the A14B models): stride 4 x 8 x 8
    return dict(base_dim=VAE21_BASE_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0, is_residual=False, in_channels=3,
                out_channels=3, patch_size=None, scale_factor_temporal=4, scale_factor_spatial=8)


def _calibration_video(size: int) -> torch.Tensor:
    """Fixed synthetic clips in [-1, 1]: flat colours, a moving square, gradients (no randomness involved)."""
    frames = 5
    ys = torch.linspace(-1, 1, size).view(1, size, 1).expand(frames, size, size)
    xs = torch.linspace(-1, 1, size).view(1, 1, size).expand(frames, size, size)
    clips = []
    for r, g, b in ((0.8, -0.6, -0.6), (-0.6, 0.8, -0.6), (-0.6, -0.6, 0.8), (0.8, 0.8, -0.8)):
        clip = torch.stack([torch.full((frames, size, size), c) for c in (r, g, b)])
        side = size // 4
        for f in range(frames):
            x0 = f * (size - side) // (frames - 1)
            clip[:, f, size // 3:size // 3 + side, x0:x0 + side] = -clip[:, f, size // 3:size // 3 + side,
                                                                         x0:x0 + side]
        clips.append(clip)
    clips.append(torch.stack([xs, ys, xs * ys]))
    clips.append(torch.stack([-ys, xs, (xs + ys) / 2]))
    return torch.stack(clips).float()


@torch.no_grad()
def calibrate_latent_stats(vae) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the VAE's latents (posterior mode) on fixed synthetic clips.

    The released configs hold statistics of the real VAE; for a random VAE they would be meaningless and the
    pipelines' (z - mean) / std would be far from unit scale. Calibrated statistics keep normalised latents near
    N(0, 1), as they are for the real models, so noise and data have comparable scale in training and sampling.
    """
    size = 2 * vae.config.scale_factor_spatial
    latents = vae.encode(_calibration_video(size)).latent_dist.mode()
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in std]


def make_vae(spec: TinyVariant, seed: int):
    from diffusers import AutoencoderKLWan

    config = vae_config(spec)
    torch.manual_seed(part_seed(seed, "vae"))
    vae = AutoencoderKLWan(**config).eval()
    mean, std = calibrate_latent_stats(vae)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return vae


def transformer_config(spec: TinyVariant) -> dict:
    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=NUM_HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=spec.in_channels,
        out_channels=spec.z_dim,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=FFN_DIM,
        num_layers=NUM_LAYERS,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
        pos_embed_seq_len=None,
    )
    if spec.image_branch:
        config.update(image_dim=CLIP_HIDDEN, added_kv_proj_dim=INNER_DIM)
        if spec.flf2v:
            config.update(pos_embed_seq_len=2 * CLIP_TOKENS)
    return config


def make_transformer(spec: TinyVariant, seed: int, part: str = "transformer"):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(part_seed(seed, part))
    return WanTransformer3DModel(**transformer_config(spec)).eval()


def make_scheduler(spec: TinyVariant):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=spec.flow_shift)


# --- the folder ------------------------------------------------------------------------------------------------

def make_tiny_pipeline(variant: str, seed: int = 0):
    """The tiny pipeline object (not saved): the diffusers pipeline class the released model_index.json names."""
    import diffusers

    if variant not in SPECS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; one of {', '.join(VARIANTS)}")
    spec = SPECS[variant]
    tokenizer = make_tokenizer()
    parts = dict(
        tokenizer=tokenizer,
        text_encoder=make_text_encoder(len(tokenizer), seed),
        vae=make_vae(spec, seed),
        scheduler=make_scheduler(spec),
        transformer=make_transformer(spec, seed, "transformer"),
    )
    if spec.two_experts:
        parts.update(transformer_2=make_transformer(spec, seed, "transformer_2"), boundary_ratio=spec.boundary_ratio)
    if spec.expand_timesteps:
        parts.update(expand_timesteps=True)
    if spec.pipeline_class == "WanImageToVideoPipeline" and spec.image_branch:
        parts.update(image_encoder=make_image_encoder(seed), image_processor=make_image_processor())
    return getattr(diffusers, spec.pipeline_class)(**parts)


def _patch_model_index(folder: Path) -> None:
    """Name the library classes as the released repos do.

    Under transformers 5 without torchvision the classes saved are T5Tokenizer (T5TokenizerFast is an alias) and
    CLIPImageProcessorPil (the fallback CLIPImageProcessor resolves to); the released repos name T5TokenizerFast and
    CLIPImageProcessor, which also load under transformers 4 and with torchvision installed.
    """
    path = folder / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("tokenizer", [None])[0] == "transformers":
        index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    if index.get("image_processor", [None])[0] == "transformers":
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    processor_config = folder / "image_processor" / "preprocessor_config.json"
    if processor_config.is_file():
        config = json.loads(processor_config.read_text(encoding="utf-8"))
        config["image_processor_type"] = "CLIPImageProcessor"
        processor_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_model(variant: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Writes a complete tiny diffusers folder for `variant` to `output_dir` and returns its path.

    An existing `output_dir` is replaced only when it is empty or itself a diffusers folder (has model_index.json);
    anything else raises FileExistsError rather than delete a folder that is not ours.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / "model_index.json").is_file():
        raise FileExistsError(f"{output_dir} exists, is not empty and holds no model_index.json; not replacing it")
    pipeline = make_tiny_pipeline(variant, seed)
    with atomic_dir(output_dir) as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True)
        _patch_model_index(tmp)
    return output_dir
