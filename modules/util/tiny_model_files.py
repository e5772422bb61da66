"""Writes a tiny diffusers Wan model's text encoder, tokenizer and image encoder in the layouts users hold them, with
the real key names, so tests can build official-release and ComfyUI folders (the inverse of the loaders' maps).

Key maps (sources; facts, not code):
- UMT5 encoder, official `models_t5_umt5-xxl-enc-bf16.pth`: the `T5Encoder` of the official Wan repository's
  `wan/modules/t5.py` (Wan-Video/Wan2.1): `token_embedding`, `blocks.N.{norm1, attn.{q,k,v,o}, norm2, ffn.{gate.0,
  fc1, fc2}, pos_embedding.embedding}`, `norm`; see WAN_T5_BLOCK_NAMES in modules/util/encoder_keys.py
  for the correspondence with transformers' UMT5 names.
- UMT5 encoder, ComfyUI `umt5_xxl_fp16.safetensors` / `umt5_xxl_fp8_e4m3fn_scaled.safetensors`: transformers' names
  without the tied `encoder.embed_tokens.weight` (comfy/text_encoders/t5.py module names), the sentencepiece model as
  a uint8 `spiece_model` tensor (comfy/text_encoders/spiece_tokenizer.py `serialize_model`), fp8_scaled as
  comfy/ops.py `scaled_fp8_ops` reads it: float8_e4m3fn Linear weights, a float32 `scale_weight` each, a
  `scaled_fp8` marker.
- CLIP vision tower, official `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`: the `XLMRobertaCLIP` of
  the official Wan repository's `wan/modules/clip.py`: `visual.{patch_embedding, cls_embedding, pos_embedding,
  pre_norm, transformer.N.{norm1, attn.to_qkv, attn.proj, norm2, mlp.0, mlp.2}, post_norm, head}` beside a `textual.*`
  XLM-RoBERTa tower (wan/modules/xlm_roberta.py names) and `log_scale` (modules/util/encoder_keys.py has the map
  to transformers' CLIP names).
- open_clip ViT: mlfoundations/open_clip `transformer.py` VisionTransformer names (`visual.conv1`,
  `transformer.resblocks.N.attn.in_proj_weight`, ...), as transformers' `convert_clip_original_pytorch_to_hf.py`
  reads OpenAI CLIP's same names.
- CLIP vision tower, ComfyUI `clip_vision_h.safetensors`: transformers' `CLIPVisionModelWithProjection` names
  (`vision_model.*`, `visual_projection.weight`), as comfy/clip_vision.py loads it.
- What ComfyUI itself writes today (checked against ComfyUI's code, no code of it here):
  - quantized layers in its mixed-precision format: comfy/utils.py `convert_old_quants` turns a legacy scaled fp8
    state dict into `<layer>.weight_scale` + `<layer>.comfy_quant` (uint8 bytes of `{"format": "float8_e4m3fn"}`),
    `<layer>.scale_input` into `<layer>.input_scale` (dropped when 1.0) and drops the `scaled_fp8` marker; comfy/ops.py
    `MixedPrecisionOps.Linear.state_dict` writes the same names when ComfyUI saves a quantized model. Other tools
    write the layer formats as safetensors metadata `_quantization_metadata` instead of `comfy_quant` tensors.
  - a text encoder saved with the CLIPSave node (comfy_extras/nodes_model_merging.py): the state dict of
    `SD1ClipModel` (comfy/sd1_clip.py) with the `umt5xxl.` and `transformer.` prefixes removed, so SDClipModel's
    `logit_scale` stays beside the T5 names; the tokenizer's `spiece_model` has neither prefix and goes to a file
    of its own.
- The official files' names and shapes these writers must produce are in tests/fixtures/official_wan_key_names.json
  (taken from the official modules' state dicts), checked by tests/test_official_key_names.py.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.util.encoder_keys import SCALED_FP8_MARKER, SPIECE_MODEL_KEY, WAN_T5_BLOCK_NAMES, WAN_T5_TOP_NAMES
from modules.util.fp8_scaled import quantise_scaled_fp8

_HF_TO_WAN_BLOCK = {hf: wan for wan, hf in WAN_T5_BLOCK_NAMES.items()}
_HF_TO_WAN_TOP = {hf: wan for wan, hf in WAN_T5_TOP_NAMES.items()}
T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
TOKENIZER_FOLDER = Path("google") / "umt5-xxl"


def umt5_to_wan_t5(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers UMT5EncoderModel state dict -> the official Wan T5 encoder's names."""
    out = {}
    for key, value in state.items():
        if key == "encoder.embed_tokens.weight":
            continue   # tied to shared.weight
        if key in _HF_TO_WAN_TOP:
            out[_HF_TO_WAN_TOP[key]] = value
            continue
        block, rest = key.removeprefix("encoder.block.").split(".", 1)
        out[f"blocks.{block}.{_HF_TO_WAN_BLOCK[rest]}"] = value
    return out


def umt5_to_comfyui(state: dict[str, torch.Tensor], stack_prefix: str = "encoder.") -> dict[str, torch.Tensor]:
    """ComfyUI's umt5_xxl file: transformers names without the tied embedding (`stack_prefix=""` drops `encoder.`)."""
    return {(stack_prefix + key.removeprefix("encoder.") if key.startswith("encoder.") else key): value
            for key, value in state.items() if key != "encoder.embed_tokens.weight"}


def is_scaled_text_encoder_weight(key: str, shape: tuple[int, ...]) -> bool:
    """A block's Linear weight (attention and feed-forward), which ComfyUI's scaled fp8 encoders store in float8."""
    return (".block." in f".{key}" and key.endswith(".weight") and len(shape) == 2
            and "relative_attention_bias" not in key)


def to_scaled_fp8_text_encoder(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's scaled fp8 encoder: every Linear weight of the blocks quantised with a per-tensor scale; the
    embedding and norms kept."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if is_scaled_text_encoder_weight(key, tuple(value.shape)):
            out[key], out[key.removesuffix(".weight") + ".scale_weight"] = quantise_scaled_fp8(value)
        else:
            out[key] = value
    out[SCALED_FP8_MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


COMFY_QUANT_FORMAT = "float8_e4m3fn"


def comfy_quant_tensor(layer_format: str = COMFY_QUANT_FORMAT) -> torch.Tensor:
    """A layer's `comfy_quant` tensor: the uint8 bytes of its JSON config (comfy/ops.py MixedPrecisionOps)."""
    return torch.tensor(list(json.dumps({"format": layer_format}).encode("utf-8")), dtype=torch.uint8)


def to_comfy_mixed_precision(state: dict[str, torch.Tensor], in_metadata: bool = False
                             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A legacy scaled-fp8 state dict (`scale_weight`, `scale_input`, `scaled_fp8`) as ComfyUI writes it now:
    `weight_scale`, `input_scale` (unless 1.0), a `comfy_quant` tensor per layer, no marker (comfy/utils.py
    convert_old_quants). With `in_metadata` the layer formats go to the `_quantization_metadata` header instead of
    `comfy_quant` tensors. Returns (tensors, metadata)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    for key, value in state.items():
        if key == SCALED_FP8_MARKER or key.endswith("." + SCALED_FP8_MARKER):
            continue
        if key.endswith(".scale_weight"):
            layer = key.removesuffix(".scale_weight")
            out[layer + ".weight_scale"] = value
            layers[layer] = {"format": COMFY_QUANT_FORMAT}
            if not in_metadata:
                out[layer + ".comfy_quant"] = comfy_quant_tensor()
        elif key.endswith(".scale_input"):
            if value.numel() != 1 or value.item() != 1.0:
                out[key.removesuffix(".scale_input") + ".input_scale"] = value
        else:
            out[key] = value
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} \
        if in_metadata else {}
    return out, metadata


def umt5_to_comfy_clipsave(state: dict[str, torch.Tensor], spiece_model: bytes | None = None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """What ComfyUI's CLIPSave writes for a Wan text encoder: (the `..._umt5xxl_NNNNN_.safetensors` tensors: T5
    names and SDClipModel's `logit_scale`, the `..._NNNNN_.safetensors` tensors: the tokenizer's `spiece_model`)."""
    weights = umt5_to_comfyui(state)
    weights["logit_scale"] = torch.tensor(4.6055)   # comfy/sd1_clip.py SDClipModel's initial value
    return weights, ({SPIECE_MODEL_KEY: spiece_model_tensor(spiece_model)} if spiece_model is not None else None)


def spiece_model_tensor(model_bytes: bytes) -> torch.Tensor:
    """A sentencepiece model as ComfyUI stores it inside a text-encoder file: a uint8 tensor of the proto bytes."""
    return torch.frombuffer(bytearray(model_bytes), dtype=torch.uint8).clone()


def train_sentencepiece(out_dir: Path, vocab_size: int = 200) -> Path:
    """A tiny real sentencepiece Unigram model (ids: <pad> 0, </s> 1, <unk> 2, as UMT5), trained on the tiny
    tokenizer's corpus; returns the .model file."""
    import sentencepiece

    from modules.util.tiny_models import tokenizer_corpus

    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / "corpus.txt"
    text.write_text("\n".join(tokenizer_corpus()), encoding="utf-8")
    prefix = out_dir / "spiece"
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


_HF_TO_WAN_CLIP_LAYER = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
                         "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}
_HF_TO_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
                          "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def _hf_clip_to_visual(state: dict[str, torch.Tensor], projection: torch.Tensor, wan: bool) -> dict[str, torch.Tensor]:
    """transformers CLIPVisionModel file (`vision_model.*`) -> `visual.*` of the official Wan CLIP (wan=True) or of
    open_clip; `projection` is the [E, D] visual_projection weight, stored transposed as `head` / `proj`."""
    hf = {key.removeprefix("vision_model."): value for key, value in state.items()}
    emb = "embeddings."
    cls, positions = hf[emb + "class_embedding"], hf[emb + "position_embedding.weight"]
    out = {   # Wan: cls [1, 1, D], positions [1, L, D]; open_clip: [D], [L, D]
        "patch_embedding.weight" if wan else "conv1.weight": hf[emb + "patch_embedding.weight"],
        "cls_embedding" if wan else "class_embedding": cls.reshape(1, 1, -1) if wan else cls,
        "pos_embedding" if wan else "positional_embedding": positions.unsqueeze(0) if wan else positions,
        "head" if wan else "proj": projection.t().contiguous(),
    }
    for side, (wan_name, open_name) in {"pre_layrnorm": ("pre_norm", "ln_pre"),
                                        "post_layernorm": ("post_norm", "ln_post")}.items():
        for param in ("weight", "bias"):
            out[f"{wan_name if wan else open_name}.{param}"] = hf[f"{side}.{param}"]
    layers = 1 + max(int(key.split(".")[2]) for key in hf if key.startswith("encoder.layers."))
    table = _HF_TO_WAN_CLIP_LAYER if wan else _HF_TO_OPEN_CLIP_LAYER
    for index in range(layers):
        base = f"encoder.layers.{index}."
        block = f"transformer.{index}." if wan else f"transformer.resblocks.{index}."
        for param in ("weight", "bias"):
            qkv = torch.cat([hf[f"{base}self_attn.{p}.{param}"] for p in ("q_proj", "k_proj", "v_proj")])
            out[block + (f"attn.to_qkv.{param}" if wan else f"attn.in_proj_{param}")] = qkv
            for hf_module, name in table.items():
                out[f"{block}{name}.{param}"] = hf[f"{base}{hf_module}.{param}"]
    return {f"visual.{key}": value for key, value in out.items()}


def hf_to_wan_clip(state: dict[str, torch.Tensor], projection: torch.Tensor) -> dict[str, torch.Tensor]:
    return _hf_clip_to_visual(state, projection, wan=True)


def hf_to_open_clip_names(state: dict[str, torch.Tensor], projection: torch.Tensor) -> dict[str, torch.Tensor]:
    return _hf_clip_to_visual(state, projection, wan=False)


def clip_vision_to_comfyui(state: dict[str, torch.Tensor], projection: torch.Tensor | None = None
                           ) -> dict[str, torch.Tensor]:
    """clip_vision_h.safetensors: CLIPVisionModelWithProjection names (a CLIPVisionModel state plus the projection)."""
    out = dict(state)
    if projection is not None:
        out["visual_projection.weight"] = projection
    return out


def xlm_roberta_text_tower(width: int = 8, layers: int = 2, vocab: int = 16, embed_dim: int | None = None
                           ) -> dict[str, torch.Tensor]:
    """The official CLIP .pth's text tower, tiny: `textual.` + Wan2.1 `wan/modules/xlm_roberta.py` XLMRoberta names
    (token / type / pos embeddings, `blocks.N.{attn.{q,k,v,o}, norm1, ffn.0, ffn.2, norm2}`, `norm`) and the
    `head.0` / `head.2` of XLMRobertaWithHead (clip.py: `width -> (width + embed_dim) // 2 -> embed_dim`, the joint
    embedding the visual `head` also projects to), plus `log_scale`. Its `token_embedding` and `blocks.N.attn.q`
    resemble Wan's T5 names: it must not be taken for a text encoder (no per-block position embedding), and it is
    not read."""
    generator = torch.Generator().manual_seed(1)
    embed_dim = embed_dim or width
    middle = (width + embed_dim) // 2
    tower = {"token_embedding.weight": (vocab, width), "type_embedding.weight": (1, width),
             "pos_embedding.weight": (vocab, width), "norm.weight": (width,), "norm.bias": (width,),
             "head.0.weight": (middle, width), "head.2.weight": (embed_dim, middle)}
    for index in range(layers):
        for name in ("q", "k", "v", "o"):
            tower[f"blocks.{index}.attn.{name}.weight"] = (width, width)
            tower[f"blocks.{index}.attn.{name}.bias"] = (width,)
        for name, shape in (("norm1", (width,)), ("norm2", (width,)), ("ffn.0", (4 * width, width)),
                            ("ffn.2", (width, 4 * width))):
            tower[f"blocks.{index}.{name}.weight"] = shape
            tower[f"blocks.{index}.{name}.bias"] = shape[:1]
    out = {f"textual.{key}": torch.randn(shape, generator=generator) for key, shape in tower.items()}
    out["log_scale"] = torch.tensor(4.6052)
    return out


def write_official_encoders(tiny_folder: Path, out: Path, with_clip: bool | None = None) -> None:
    """An official-release folder's encoder files from a tiny diffusers folder: the T5 `.pth`, the CLIP `.pth`
    (when the model has an image encoder) and the `google/umt5-xxl/` tokenizer folder."""
    out.mkdir(parents=True, exist_ok=True)
    text = load_file(str(_only_weights(tiny_folder / "text_encoder")))
    torch.save(umt5_to_wan_t5(text), out / T5_FILE)
    if with_clip is None:
        with_clip = (tiny_folder / "image_encoder").is_dir()
    if with_clip:
        vision = load_file(str(_only_weights(tiny_folder / "image_encoder")))
        width = vision["vision_model.post_layernorm.weight"].shape[0]
        official = hf_to_wan_clip(vision, torch.zeros(width // 2, width))
        official.update(xlm_roberta_text_tower(embed_dim=width // 2))
        torch.save(official, out / CLIP_FILE)
    shutil.copytree(tiny_folder / "tokenizer", out / TOKENIZER_FOLDER, dirs_exist_ok=True)


def write_comfy_encoders(tiny_folder: Path, out: Path, fp8_scaled: bool = False,
                         spiece_model: bytes | None = None) -> dict[str, Path]:
    """ComfyUI's `text_encoders/umt5_xxl_*.safetensors` and `clip_vision/clip_vision_h.safetensors` from a tiny
    diffusers folder; returns {part: file}."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    text = umt5_to_comfyui(load_file(str(_only_weights(tiny_folder / "text_encoder"))))
    if fp8_scaled:
        text = to_scaled_fp8_text_encoder(text)
    if spiece_model is not None:
        text[SPIECE_MODEL_KEY] = spiece_model_tensor(spiece_model)
    name = "umt5_xxl_fp8_e4m3fn_scaled.safetensors" if fp8_scaled else "umt5_xxl_fp16.safetensors"
    files["text_encoder"] = out / name
    save_file(text, str(files["text_encoder"]))
    if (tiny_folder / "image_encoder").is_dir():
        vision = load_file(str(_only_weights(tiny_folder / "image_encoder")))
        width = vision["vision_model.post_layernorm.weight"].shape[0]
        files["image_encoder"] = out / "clip_vision_h.safetensors"
        save_file(clip_vision_to_comfyui(vision, torch.zeros(width // 2, width)), str(files["image_encoder"]))
    return files


def write_open_clip_vision(tiny_folder: Path, out_file: Path) -> None:
    """An open_clip ViT checkpoint (`visual.conv1`, `visual.transformer.resblocks.N...`) of the tiny image encoder."""
    vision = load_file(str(_only_weights(tiny_folder / "image_encoder")))
    width = vision["vision_model.post_layernorm.weight"].shape[0]
    torch.save(hf_to_open_clip_names(vision, torch.zeros(width // 2, width)), out_file)


def _only_weights(folder: Path) -> Path:
    [weights] = sorted(folder.glob("*.safetensors"))
    return weights
