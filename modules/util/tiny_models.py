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
import math
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.util.portable_folder import make_portable
from modules.util.atomic import atomic_dir

VARIANTS = ("wan2.1-t2v", "wan2.1-i2v", "wan2.1-flf2v", "wan2.2-ti2v-5b", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b",
            "wan2.1-vace", "wan2.2-vace-fun-a14b", "wan2.1-fun-control", "wan2.1-fun-inp",
            "wan2.2-fun-control-a14b")
ANIMATE_VARIANTS = ("wan2.2-animate", "wan2.2-animate-2")   # modules/util/tiny_animate.py

# --- sizes of the tiny parts -----------------------------------------------------------------------------------

# Widths are all different from each other (and from the latent channels 16 / 48), as in the real models (text
# 4096, transformer 1536 / 3072 / 5120, CLIP 1280), so code that mixes them up fails on the tiny models too.
TEXT_DIM = 32            # UMT5 d_model == transformer text_dim
NUM_HEADS = 2
# rope splits 32 as 12 (t) / 10 (h) / 10 (w), like 128 -> 44 / 42 / 42 in the real models. Narrower heads learn text
# conditioning far too slowly: with qk-norm the attention logits are bounded by about sqrt(HEAD_DIM), and the few
# prompt tokens compete with ~500 identical padding keys (measured: 20-wide heads stay near chance after 3000 steps,
# 32-wide heads learn the demo's six captions in 1500).
HEAD_DIM = 32
INNER_DIM = NUM_HEADS * HEAD_DIM   # 64
FFN_DIM = 4 * INNER_DIM
NUM_LAYERS = 2
# VACE: four base blocks, VACE blocks feeding blocks 0 and 2 (every second block, as in VACE 1.3B and as ComfyUI
# assumes for a file without a config); 96 control channels = 16 + 16 latent channels + 64 folded mask channels
VACE_NUM_LAYERS = 4
VACE_LAYERS = [0, 2]
VACE_IN_CHANNELS = 96
# Wan-Fun InP 1.3B is the I2V layout (36 input channels) told from Wan 2.1 I2V by its width alone (no 1.3B I2V
# exists; modules/util/wan_detection.fun_variant), so its tiny model keeps the released width: 12 heads of 128 =
# 1536 (alibaba-pai/Wan2.1-Fun-1.3B-InP config.json: dim 1536, num_heads 12), with the other sizes tiny
RELEASED_1_3B_HEADS = 12
RELEASED_1_3B_HEAD_DIM = 128

CLIP_IMAGE_SIZE = 32
CLIP_PATCH_SIZE = 8
CLIP_HIDDEN = 24
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
    vace: bool = False           # WanVACETransformer3DModel (VACE blocks fed a control context)
    released_1_3b_width: bool = False   # 12 heads of 128 (the 1.3B's 1536) instead of the tiny width


def _spec(name: str, pipeline_class: str, in_channels: int, z_dim: int = 16, image_branch: bool = False,
          flf2v: bool = False, boundary_ratio: float | None = None, expand_timesteps: bool = False,
          flow_shift: float = FLOW_SHIFT_DEFAULT, released_1_3b_width: bool = False) -> TinyVariant:
    return TinyVariant(name, pipeline_class, in_channels, z_dim, image_branch, flf2v, boundary_ratio is not None,
                       boundary_ratio, expand_timesteps, flow_shift, vace=pipeline_class == "WanVACEPipeline",
                       released_1_3b_width=released_1_3b_width)


SPECS = {spec.name: spec for spec in (
    _spec("wan2.1-t2v", "WanPipeline", in_channels=16),
    _spec("wan2.1-i2v", "WanImageToVideoPipeline", in_channels=36, image_branch=True),
    _spec("wan2.1-flf2v", "WanImageToVideoPipeline", in_channels=36, image_branch=True, flf2v=True,
          flow_shift=FLOW_SHIFT_FLF2V),
    # TI2V-5B is one WanPipeline model for text- and image-to-video; its I2V runs through WanImageToVideoPipeline
    # loaded from the same folder (expand_timesteps: the first latent frame is the image, timestep 0 there)
    _spec("wan2.2-ti2v-5b", "WanPipeline", in_channels=48, z_dim=48, expand_timesteps=True,
          flow_shift=FLOW_SHIFT_TI2V),
    _spec("wan2.2-t2v-a14b", "WanPipeline", in_channels=16, boundary_ratio=0.875),
    # I2V-A14B has no CLIP: image_encoder/image_processor are null, the transformer has no image_dim
    _spec("wan2.2-i2v-a14b", "WanImageToVideoPipeline", in_channels=36, boundary_ratio=0.9),
    _spec("wan2.1-vace", "WanVACEPipeline", in_channels=16),
    # boundary 0.875 as linoyts/Wan2.2-VACE-Fun-14B-diffusers' model_index.json (the T2V-A14B experts' boundary)
    _spec("wan2.2-vace-fun-a14b", "WanVACEPipeline", in_channels=16, boundary_ratio=0.875),
    # Wan2.1-Fun Control: the I2V model with control + start-image channels (48 = 3 x 16; VideoX-Fun model_type
    # "i2v", CLIP image tokens); diffusers has no pipeline of its own for it, the I2V pipeline's parts fit
    _spec("wan2.1-fun-control", "WanImageToVideoPipeline", in_channels=48, image_branch=True),
    # Wan2.1-Fun InP 1.3B: the I2V channels (16 noise + 4 mask + 16 masked video; VideoX-Fun
    # pipeline_wan_fun_inpaint.py) and CLIP image tokens (VideoX-Fun model_type "i2v") at the 1.3B width
    _spec("wan2.1-fun-inp", "WanImageToVideoPipeline", in_channels=36, image_branch=True, released_1_3b_width=True),
    # Wan2.2-Fun Control A14B: the I2V-A14B experts (no CLIP) with control 16 + mask 4 + masked video 16 (52 = 16 + 36;
    # VideoX-Fun pipeline_wan2_2_fun_control.py), boundary 0.900 as its config/wan2.2/wan_civitai_i2v.yaml
    _spec("wan2.2-fun-control-a14b", "WanImageToVideoPipeline", in_channels=52, boundary_ratio=0.9),
)}
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


def _pre_tokenizer():
    """The pre-tokenization T5TokenizerFast itself applies, so the pieces learned are the ones it can produce."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])


def _reestimate_scores(pieces: list[str], corpus: list[str], iterations: int = 3) -> list[tuple[str, float]]:
    """Deterministic Unigram scores for the trained pieces: Viterbi-EM over the corpus words, in Python.

    The `tokenizers` Unigram trainer is not deterministic (Rust hash-map order changes its scores in the third
    decimal and the order of the pieces from one process to the next), but tokens ids must be reproducible: they
    index the text encoder's embedding rows. Its piece set is stable, so the pieces are kept and their scores
    re-estimated here from a deterministic start (log of substring frequency times length, as SentencePiece seeds
    its pieces), then ordered by score.
    """
    from tokenizers import Tokenizer, models

    pre_tokenizer = _pre_tokenizer()
    word_counts: dict[str, int] = {}
    for line in corpus:
        for word, _ in pre_tokenizer.pre_tokenize_str(line):
            word_counts[word] = word_counts.get(word, 0) + 1
    words = sorted(word_counts)
    seed_counts = [sum(word_counts[w] * w.count(p) for w in words) * len(p) for p in pieces]
    scores = [math.log(max(count, 1)) for count in seed_counts]
    for _ in range(iterations):
        norm = math.log(sum(math.exp(s) for s in scores))
        scores = [s - norm for s in scores]
        model = Tokenizer(models.Unigram([(p, s) for p, s in zip(pieces, scores)], unk_id=None, byte_fallback=False))
        usage = [0] * len(pieces)
        for word, encoding in zip(words, model.encode_batch(words, add_special_tokens=False)):
            for token_id in encoding.ids:
                usage[token_id] += word_counts[word]
        total = sum(usage)
        floor = math.log(0.5 / total)   # pieces Viterbi never picks (rare characters) stay, below every used one
        scores = [math.log(u / total) if u else floor for u in usage]
    ranked = sorted(zip(pieces, scores), key=lambda item: (-item[1], item[0]))
    return [(piece, round(score, 6)) for piece, score in ranked]


def make_tokenizer():
    """A Unigram tokenizer trained with `tokenizers` on the built-in corpus, wrapped as T5TokenizerFast.

    Same layout as the UMT5 tokenizer: <pad> 0, </s> 1, <unk> 2, SentencePiece-style "▁" word prefixes, </s>
    appended. Every ASCII letter, digit and punctuation mark is in the vocabulary, so ASCII text never hits <unk>.
    """
    from tokenizers import Tokenizer, models, trainers
    from transformers import T5TokenizerFast

    corpus = tokenizer_corpus()
    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.UnigramTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        unk_token="<unk>",
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
        max_piece_length=16,
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    trained = [piece for piece, _ in json.loads(backend.to_str())["model"]["vocab"]]
    if trained[:3] != _SPECIAL_TOKENS:
        raise RuntimeError(f"tokenizer training put {trained[:3]} first, expected {_SPECIAL_TOKENS}")
    pieces = sorted(trained[3:])
    vocab = [(token, 0.0) for token in _SPECIAL_TOKENS] + _reestimate_scores(pieces, corpus)
    # T5TokenizerFast builds its backend from (piece, score) pairs, exactly as it does again when loading the saved
    # tokenizer.json, so the saved and the loaded tokenizer are the same. No sentinel <extra_id_N> tokens.
    return T5TokenizerFast(vocab=vocab, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)


# --- model parts -----------------------------------------------------------------------------------------------

def make_text_encoder(vocab_size: int, seed: int):
    """UMT5 encoder shaped like umt5-xxl (gated-gelu, relative attention buckets 32 / distance 128), d_model 32.

    (transformers 5 forces tie_word_embeddings=True for the T5 family; an encoder has no head, so it changes nothing.)
    """
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
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(part_seed(seed, "text_encoder"))
    return UMT5EncoderModel(config).eval()


def make_image_encoder(seed: int):
    """CLIP ViT shaped like ViT-H/14 but 32x32 pixels, 8x8 patches (17 tokens), hidden 24, two layers."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=CLIP_HIDDEN,
        intermediate_size=2 * CLIP_HIDDEN,
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
    size = 4 * vae.config.scale_factor_spatial   # 4 x 4 latents per frame
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
    if spec.released_1_3b_width:
        config.update(num_attention_heads=RELEASED_1_3B_HEADS, attention_head_dim=RELEASED_1_3B_HEAD_DIM)
    if spec.image_branch:
        # the image tokens' keys and values are projected from the transformer's width
        config.update(image_dim=CLIP_HIDDEN,
                      added_kv_proj_dim=config["num_attention_heads"] * config["attention_head_dim"])
        if spec.flf2v:
            config.update(pos_embed_seq_len=2 * CLIP_TOKENS)
    if spec.vace:
        config.update(num_layers=VACE_NUM_LAYERS, vace_layers=list(VACE_LAYERS), vace_in_channels=VACE_IN_CHANNELS)
    return config


def make_transformer(spec: TinyVariant, seed: int, part: str = "transformer"):
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    torch.manual_seed(part_seed(seed, part))
    model_class = WanVACETransformer3DModel if spec.vace else WanTransformer3DModel   # diffusers' random init
    return model_class(**transformer_config(spec)).eval()


def make_scheduler(spec: TinyVariant):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=spec.flow_shift)


# --- the folder ------------------------------------------------------------------------------------------------

def make_tiny_pipeline(variant: str, seed: int = 0):
    """The tiny pipeline object (not saved): the diffusers pipeline class the released model_index.json names."""
    import diffusers

    if variant in ANIMATE_VARIANTS:
        from modules.util.tiny_animate import make_animate_pipeline
        return make_animate_pipeline(variant, seed)
    if variant not in SPECS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; one of {', '.join(VARIANTS + ANIMATE_VARIANTS)}")
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


def replaceable_folder(output_dir: str | Path) -> Path:
    """`output_dir` as a Path, when it is missing, empty or a diffusers folder (has model_index.json); anything else
    raises FileExistsError rather than let a writer delete a folder that is not ours."""
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / "model_index.json").is_file():
        raise FileExistsError(f"{output_dir} exists, is not empty and holds no model_index.json; not replacing it")
    return output_dir


def make_tiny_model(variant: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Writes a complete tiny diffusers folder for `variant` to `output_dir` and returns its path.

    An existing `output_dir` is replaced only when it is empty or itself a diffusers folder (has model_index.json);
    anything else raises FileExistsError rather than delete a folder that is not ours.
    """
    output_dir = replaceable_folder(output_dir)
    pipeline = make_tiny_pipeline(variant, seed)
    with atomic_dir(output_dir) as tmp:
        if isinstance(pipeline, dict):   # Animate-2's parts (its diffusers pipeline is modular)
            from modules.util.tiny_animate import save_animate_2
            save_animate_2(pipeline, Path(tmp))
        else:
            pipeline.save_pretrained(tmp, safe_serialization=True)
        make_portable(tmp)   # loads under transformers 4 too, as the released repos do
    return output_dir
