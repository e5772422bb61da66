"""A tiny random Qwen2.5-VL (the captioner's model class) saved as a model folder, built offline from configs.

The folder has what a hub snapshot of Qwen/Qwen2.5-VL-7B-Instruct has for the captioner: config.json and the weights,
a byte-level BPE Qwen2 tokenizer with Qwen's special tokens and chat template, and preprocessor_config.json. Its
captions are nonsense; the loading, prompting, image tokens and generation are the real ones.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]

# Qwen2.5-VL's chat template reduced to what a caption request uses (user turns of images, videos and text; the
# default system turn); the special tokens and layout are those of the hub model's chat_template.json
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_qwen_vl(folder: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    # every byte is a token (no merges): any text encodes, and the special tokens come after the 256 bytes
    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(bytes_to_unicode().values())}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"],
                         # head_dim 8: mrope splits its 4 rotary frequencies over time, height, width
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # few pixels per picture keep the tiny model's sequences short
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(folder)
    return folder
